"""API names the operator and its manifests share (group ``freetoken.io``, ``v1alpha1``)."""

GROUP = "freetoken.io"
VERSION = "v1alpha1"
MODELS = "freetokenmodels"
NODES = "freetokennodes"
MODEL_KIND = "FreeTokenModel"
NODE_KIND = "FreeTokenNode"

MANAGED_BY = "freetoken-operator"
LABEL_MODEL = "freetoken.io/model"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICE_MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
FINALIZER = "freetoken.io/finalizer"


def model_key(namespace: str, name: str) -> str:
    """The key a model's replicas carry on nodes: ``"<namespace>.<name>"`` (contracts.md)."""
    return f"{namespace}.{name}"
