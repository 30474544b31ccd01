"""MoEfication: turning a dense llama (the GGUF of SmolLM2-135M-Instruct) into a
`freetoken_llama_moe` checkpoint.

Data flow:

    offline, once (fit.py):      GGUF -> dense model -> MLP inputs on the fitting text (corpus.py)
                                 -> per layer: neuron permutation [I] + router [E, H]
                                 -> data/smollm2_135m_e16.safetensors + .json (sha256 of the GGUF)
    first use (build.py):        GGUF + data/ -> moe.py split -> MoE folder (models/default.py
                                 puts it in the engine cache)
    evaluation (evaluate.py, routing.py): perplexity and routing statistics, used by fit.py and
                                 bench/default_model.py

Everything here runs on transformers' llama as the reference forward; the engine has its own.
"""
