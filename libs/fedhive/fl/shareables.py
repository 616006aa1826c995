"""Shareable generators: turn the global model into a task's data and a round's aggregate
back into the global model (FLARE's ShareableGenerator, on Dxos)."""

from __future__ import annotations

from typing import Any, ClassVar

from fedhive.blobs import TensorRef
from fedhive.blobs.dtypes import is_torch_tensor
from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.model_store import ModelStore, TensorSpec, compute_dtype, from_compute, to_compute


class ShareableGenerator:
    """Base type workflows look up by `shareable_generator_id`. One without `accepts_lazy`
    is given materialized models (arrays) by the workflows."""

    accepts_lazy: ClassVar[bool] = False
    models: ModelStore | None = None

    def bind(self, models: ModelStore) -> None:
        """The job's tensor store (called by the workflow before its first round): lets the
        generator work on lazy models, one tensor at a time."""
        self.models = models

    def learnable_to_shareable(self, model: Dxo) -> Dxo:
        raise NotImplementedError

    def shareable_to_learnable(self, dxo: Dxo, model: Dxo) -> Dxo:
        raise NotImplementedError


class FullModelShareableGenerator(ShareableGenerator):
    """The whole model goes out as WEIGHTS; a WEIGHTS result replaces the arrays it names (the
    others, e.g. ones the aggregator excluded, are kept), a WEIGHT_DIFF result is added to them.
    A replacement or a diff must have the shape and dtype of the model's array.

    WEIGHTS may be lazy (refs are kept as they are, so a relay forwards a site's model without
    reading it). A WEIGHT_DIFF is added tensor by tensor when the generator is bound to the
    job's store (each sum stored at its content key, nothing else held); unbound, the diff and
    the model must be materialized.
    """

    accepts_lazy = True

    def learnable_to_shareable(self, model: Dxo) -> Dxo:
        if model.data_kind is not DataKind.WEIGHTS:
            raise InvalidArgument(f"the global model must be WEIGHTS, not "
                                  f"{model.data_kind.value}", field="data_kind")
        return Dxo(DataKind.WEIGHTS, dict(model.data), dict(model.meta))

    def shareable_to_learnable(self, dxo: Dxo, model: Dxo) -> Dxo:
        data = dict(model.data)
        if dxo.data_kind is DataKind.WEIGHTS:
            for name, value in dxo.data.items():
                if name in data:
                    _fits(name, value, data[name])
                data[name] = value
        elif dxo.data_kind is DataKind.WEIGHT_DIFF:
            lazy = dxo.is_lazy or model.is_lazy
            if lazy and self.models is None:
                raise InvalidArgument("a WEIGHT_DIFF and the model it updates must be "
                                      "materialized", field="data")
            for name, diff in dxo.data.items():
                if name not in data:
                    raise InvalidArgument(f"the diff names {name!r}, which the model lacks",
                                          field=name)
                _fits(name, diff, data[name])
            if lazy:
                assert self.models is not None
                data.update(_add_streamed(self.models, dxo, data))
            else:
                for name, diff in dxo.data.items():
                    data[name] = _add(data[name], diff)
        else:
            raise InvalidArgument(f"a {dxo.data_kind.value} DXO cannot update the model",
                                  field="data_kind")
        return Dxo(DataKind.WEIGHTS, data, dict(model.meta))


def _fits(name: str, new: Any, old: Any) -> None:
    """InvalidArgument naming the tensor when `new` cannot stand in for (or be added to) `old`:
    another shape or dtype (numpy and torch name dtypes alike)."""
    if tuple(new.shape) != tuple(old.shape):
        raise InvalidArgument(f"tensor {name!r} has shape {tuple(new.shape)}, the model's is "
                              f"{tuple(old.shape)}", field=name)
    new_spec, old_spec = TensorSpec.of(name, new), TensorSpec.of(name, old)
    if new_spec.dtype != old_spec.dtype:
        raise InvalidArgument(f"tensor {name!r} has dtype {new_spec.dtype}, the model's is "
                              f"{old_spec.dtype}", field=name)


def _add_streamed(models: ModelStore, diff: Dxo, data: dict[str, Any]) -> dict[str, TensorRef]:
    """model + diff for each tensor the diff names, one tensor at a time, stored."""
    writer = models.writer()
    out: dict[str, TensorRef] = {}
    for name, change in diff.data.items():
        base = data[name]
        spec = TensorSpec.of(name, base)
        storage, owned = models.fetch_value(name, base)
        total = to_compute(storage, spec.dtype, owned=owned)
        del storage
        change_spec = TensorSpec.of(name, change)
        storage, owned = models.fetch_value(name, change)
        addend = to_compute(storage, change_spec.dtype, owned=owned)
        del storage
        total += addend.astype(compute_dtype(spec.dtype), copy=False)
        del addend
        out[name] = writer.put(name, from_compute(total, spec.dtype), dtype=spec.dtype,
                               kind=spec.kind)
    return out


def _add(model: Any, diff: Any) -> Any:
    """model + diff in the model's type and dtype (a numpy diff on a torch model, too)."""
    if is_torch_tensor(model):
        if not is_torch_tensor(diff):
            import torch

            diff = torch.as_tensor(diff)
        return (model + diff.to(model.device)).to(model.dtype)
    if is_torch_tensor(diff):
        diff = diff.detach().cpu().numpy()
    return (model + diff).astype(model.dtype, copy=False)
