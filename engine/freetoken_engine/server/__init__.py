"""The HTTP layer: OpenAI- and Anthropic-compatible API, admin routes, metrics.

Data flow of one request:

    HTTP body --(openai_schema / anthropic_schema: validate, 400 naming the field)-->
    template messages --(prompt.build_prompt: chat template, tool pre-fill)--> prompt ids
    --(generation.start_choices: context budget 413, structured.guide_spec: the grammar,
       EngineService.submit: 429/400)-->
    Generation per choice (token events -> detokenized text, stop strings, log-probabilities)
    --(parser.OutputParser: <think> / <tool_call> split)--> events
    --(openai_api / anthropic_api)--> JSON or SSE chunks

``app.create_app(service, ServerConfig)`` builds the FastAPI app around an EngineService;
``serve.serve_main(args)`` is ``freetoken serve``. Errors are mapped to HTTP in ``errors``
only. Nothing here touches tensors: the server imports the scheduler's service, never below.
"""
