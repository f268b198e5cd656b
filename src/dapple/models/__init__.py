"""Models: what training needs from a torch model, as a chain of layers the planner cuts.

- :mod:`~dapple.models.workload`: :class:`Workload` (layer factories, batch maker, loss);
- :mod:`~dapple.models.zoo`: MLP, transformer, VGG-19, ResNet-50, GNMT as layer chains;
- :mod:`~dapple.models.split`, :mod:`~dapple.models.split_graph` (tracing and cutting) and
  :mod:`~dapple.models.split_pieces` (the pieces with their weights): any traceable
  ``nn.Module`` cut into a chain; :mod:`~dapple.models.tied`: parameters shared across pieces;
- :mod:`~dapple.models.hf`: Hugging Face models built from a config (needs ``transformers``);
- :mod:`~dapple.models.spec`: :func:`load` a workload from a spec string.

Imports only :mod:`dapple.core` and :mod:`dapple.errors` from dapple. Import the sub-module you
need; this package imports nothing eagerly.
"""

__all__ = ["hf", "spec", "split", "split_graph", "tied", "workload", "zoo"]
