"""Build a model without its weights, then make real only the parameters a rank needs.

Design choices:
    - :func:`build_meta` runs the model's factory with the parameters of *re-initialisable*
      modules created on the ``meta`` device: modules whose class has ``reset_parameters``
      (every torch layer with weights) and Hugging Face modules (their ``PreTrainedModel``
      re-initialises them with ``_init_weights``). A 7B model built so costs no parameter
      memory. Buffers, and parameters of other modules (a position table or gates made with
      ``nn.Parameter(torch.randn(...))`` in a custom ``__init__``), keep their constructor values:
      the factory runs under the run's seed, so they are the same in every process.
    - :func:`init_parameters` gives real values to chosen parameters by fully qualified name.
      Each parameter is initialised by its *owning module's own init* under a seed derived from
      the run seed and the owner's name, so a parameter's initial value does not depend on which
      other parameters a process makes real: a rank holding one stage gets exactly the weights
      of the whole model (:func:`materialize`) and tied copies start equal.
    - The owner's init is ``reset_parameters()`` (``_reset_parameters()`` for
      ``nn.MultiheadAttention``); inside a Hugging Face model it is the model's
      ``_init_weights`` applied to the owner and then to each ancestor up to the model, the
      order ``PreTrainedModel.init_weights`` uses, so schemes set by a parent (GPT-2's scaled
      residual projections) apply. The ancestors are shallow copies whose other children stay
      on ``meta``, where initialisation is a no-op and draws no random numbers.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from dapple.errors import ValidationError

__all__ = ["build_meta", "canonical_names", "init_parameters", "is_meta_built", "materialize"]

_SEED_MOD = 2**63 - 1


def _is_hf_module(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _reinitialisable(module: nn.Module) -> bool:
    """True when the module's parameters can be made again by an init method."""
    return (
        callable(getattr(module, "reset_parameters", None))
        or isinstance(module, nn.MultiheadAttention)
        or _is_hf_module(module)
    )


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """While active, parameters registered on re-initialisable modules move to ``meta``."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and _reinitialisable(self):
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_meta(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Run ``factory`` under ``seed`` with re-initialisable parameters on ``meta``.

    Args:
        factory: Builds the model (random init from the global RNG).
        seed: Torch seed the factory runs under (constructor values of kept parameters).

    Raises:
        ValidationError: The factory did not return an ``nn.Module``.
    """
    with torch.random.fork_rng(devices=[]), _meta_parameters():
        torch.manual_seed(seed)
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValidationError(f"the model factory returned {type(model).__name__}, not nn.Module")
    return model


def is_meta_built(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the ``meta`` device."""
    return any(p.is_meta for p in model.parameters())


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name (aliases of tied parameters included) -> its first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _owner_seed(seed: int, owner: str) -> int:
    digest = hashlib.sha256(f"{seed}/{owner}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _SEED_MOD


def _hf_root(model: nn.Module, owner: str) -> tuple[str, nn.Module] | None:
    """The nearest ancestor of ``owner`` (or the model) with Hugging Face's ``_init_weights``."""
    parts = owner.split(".") if owner else []
    for k in range(len(parts), -1, -1):
        name = ".".join(parts[:k])
        mod = model.get_submodule(name)
        if callable(getattr(mod, "_init_weights", None)) and hasattr(mod, "config"):
            return name, mod
    return None


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing children; own parameters and buffers are new dicts (meta ones kept)."""
    out = copy.copy(module)
    out._parameters = dict(module._parameters)
    out._buffers = {k: None if b is None else b.clone() for k, b in module._buffers.items()}
    out._modules = dict(module._modules)
    return out


def _init_owner(model: nn.Module, owner: str, device: torch.device) -> nn.Module:
    """A copy of module ``owner`` whose meta parameters are real and initialised."""
    mod = model.get_submodule(owner)
    made = _shallow(mod)
    for key, p in mod._parameters.items():
        if p is not None and p.is_meta:
            made._parameters[key] = nn.Parameter(
                torch.empty_like(p, device=device), requires_grad=p.requires_grad
            )
    hf = _hf_root(model, owner)
    with torch.no_grad():
        if hf is not None:
            root_name, root = hf
            init = cast(Callable[[nn.Module], None], root._init_weights)
            init(made)
            child, path = made, owner
            while path != root_name:  # ancestors up to the HF model, each after its children
                path, _, leaf = path.rpartition(".")
                parent = _shallow(model.get_submodule(path))
                parent._modules[leaf] = child
                init(parent)
                child = parent
        elif callable(getattr(mod, "reset_parameters", None)):
            cast(Callable[[], None], made.reset_parameters)()
        elif isinstance(mod, nn.MultiheadAttention):
            cast(nn.MultiheadAttention, made)._reset_parameters()
        else:
            raise ValidationError(
                f"cannot initialise the parameters of {owner or 'the model'!r} "
                f"({type(mod).__name__}): it has no reset_parameters()"
            )
    return made


def init_parameters(
    model: nn.Module,
    names: Iterable[str],
    seed: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Real initial values of the named parameters of a :func:`build_meta` model.

    Args:
        model: A model from :func:`build_meta` (not modified).
        names: Fully qualified parameter names (aliases of tied parameters allowed).
        seed: The run seed; with the owner's name it seeds the owner's init.
        device: Where the values are made.

    Returns:
        ``name -> tensor`` (a parameter the factory kept real is cloned).

    Raises:
        ValidationError: An unknown name, or an owner without an init method.
    """
    dev = torch.device(device)
    canonical = canonical_names(model)
    wanted = list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in canonical]
    if unknown:
        raise ValidationError(f"{type(model).__name__} has no parameters {unknown}")
    owners: dict[str, list[str]] = {}
    for name in wanted:
        owners.setdefault(canonical[name].rpartition(".")[0], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for owner, members in owners.items():
        made: nn.Module | None = None
        for name in members:
            leaf = canonical[name].rpartition(".")[2]
            p = model.get_submodule(owner)._parameters[leaf]
            assert p is not None
            if not p.is_meta:
                out[name] = p.detach().to(dev, copy=True)
                continue
            if made is None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_owner_seed(seed, owner))
                    made = _init_owner(model, owner, dev)
            value = made._parameters[leaf]
            assert value is not None
            out[name] = value.detach()
    return out


def materialize(
    model: nn.Module,
    seed: int,
    device: torch.device | str = "cpu",
    values: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """Make every parameter of a :func:`build_meta` model real, in place (tied stay tied).

    Args:
        model: A model from :func:`build_meta`.
        seed: The run seed (as in :func:`init_parameters`).
        device: Where parameters and buffers go.
        values: ``names -> tensors`` instead of :func:`init_parameters` (pretrained weights).
    """
    names = [n for n, _ in model.named_parameters()]
    made_values = (
        values(names) if values is not None else init_parameters(model, names, seed, device)
    )
    made: dict[int, nn.Parameter] = {}
    holders: list[tuple[nn.Module, str, Any]] = [
        (mod, key, p)
        for mod in model.modules()
        for key, p in mod._parameters.items()
        if p is not None
    ]
    by_id = {id(p): name for name, p in model.named_parameters()}
    for mod, key, p in holders:
        if id(p) not in made:
            made[id(p)] = nn.Parameter(made_values[by_id[id(p)]], p.requires_grad)
        mod._parameters[key] = made[id(p)]
    return model.to(device)
