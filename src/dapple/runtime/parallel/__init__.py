"""How one stage is split over its devices: a tensor group cuts its layers (``tp``, Megatron
style), its replicas shard the optimizer state and gradients (``zero``: ZeRO-1/2) or the
parameters too (``fsdp``: ZeRO-3 through FSDP2), its expert groups shard its MoE layers'
experts (``expert``: expert parallelism), ``stage_mesh`` builds the stage's device mesh
and applies them, ``tensor_check`` refuses what cannot be cut before any compute, and
``sharded_state`` gathers a cut stage's layers whole for checkpoints and resumes."""
