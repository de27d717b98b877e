"""STUB: placeholder for the DSPINE SGLang worker (`DSpineWorkerV2`, a `DFlashWorkerV2` subclass).

Exists only so the plugin's lazy worker factory has an import path to resolve; the real worker
comes with the worker/model-class task. Constructing it raises.
"""


class DSpineWorkerV2:
    """STUB. SGLang calls `DSpineWorkerV2(server_args=, gpu_id=, nccl_port=, target_worker=[, ps=])`."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "DSpineWorkerV2 is a stub: the DSPINE SGLang worker is not implemented yet "
            "(dspine/sglang/worker.py). --speculative-algorithm DSPINE cannot serve requests in this build.")
