"""Model zoo: real torch models expressed as :class:`dapple.models.workload.Workload` layer chains.

Small defaults run in seconds on a CPU (``mlp``, ``transformer``, ``gnmt``); ``bert-48``,
``gnmt-16``, ``vgg19`` and ``resnet50`` are the paper's sizes (override sizes by keyword).
"""

from dapple.models.zoo.cnn import resnet50, vgg19
from dapple.models.zoo.gnmt import gnmt
from dapple.models.zoo.loader import NAMES, get_workload, load_workload, workload_from_sequential
from dapple.models.zoo.mlp import mlp
from dapple.models.zoo.transformer import transformer

__all__ = [
    "NAMES",
    "get_workload",
    "gnmt",
    "load_workload",
    "mlp",
    "resnet50",
    "transformer",
    "vgg19",
    "workload_from_sequential",
]
