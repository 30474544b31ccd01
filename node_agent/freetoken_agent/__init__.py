"""FreeToken node agent: one per GPU node (a DaemonSet, or standalone on a single machine).

It calibrates the node's PCIe and CPU-expert bandwidth (``calibration``), runs one engine
process per assigned model (``replica``), watches VRAM / host-memory pressure and resizes the
engines' expert caches (``gpu``, ``host``, ``policy``, ``pressure``), reports to the cluster's
``FreeTokenNode`` (``kube``, ``snapshot``) and exports Prometheus metrics (``metrics``).
The loop that ties them together is ``agent.Agent``; the command line is ``cli``.

It talks to engines over HTTP and runs ``freetoken`` commands as subprocesses: it never
imports the engine package or torch. Contracts: docs/contracts.md.
"""
