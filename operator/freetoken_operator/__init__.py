"""FreeToken operator: places FreeTokenModels onto FreeTokenNodes (kopf, no torch).

Data flow, one reconcile pass (level-based; runs on every watch event and on a 1 s tick)::

    watch events ──► observe.Store            raw FreeTokenModel / FreeTokenNode / Node bodies
                       │ model_views(), node_views(now), previous_placements()
                       ▼
                     plan.plan(models, nodes, previous) -> Plan     pure, no I/O
                       │ placements {model key -> (Placement(node, port), ...)}, decisions, why-not
                       ▼
                     status.desired(...) -> DesiredState            pure: node specs, model status,
                       │                                            Services, EndpointSlices, events
                       ▼
                     apply.Applier.apply(desired)                  the only module that writes
                                                                    to the Kubernetes API

Modules: ``config`` (the one place that reads environment variables), ``resources`` (API
names), ``observe``, ``plan``, ``status``, ``objects`` (Service, EndpointSlice and node-spec
builders), ``apply``, ``reconciler`` (the loop), ``handlers`` (kopf registrations), ``cli`` (the
``freetoken-operator`` console script).
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
