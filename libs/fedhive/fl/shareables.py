"""Shareable generators: turn the global model into a task's data and a round's aggregate
back into the global model (FLARE's ShareableGenerator, on Dxos)."""

from __future__ import annotations

from typing import Any

from fedhive.blobs.dtypes import is_torch_tensor
from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo


class ShareableGenerator:
    """Base type workflows look up by `shareable_generator_id`."""

    def learnable_to_shareable(self, model: Dxo) -> Dxo:
        raise NotImplementedError

    def shareable_to_learnable(self, dxo: Dxo, model: Dxo) -> Dxo:
        raise NotImplementedError


class FullModelShareableGenerator(ShareableGenerator):
    """The whole model goes out as WEIGHTS; a WEIGHTS result replaces the arrays it names (the
    others, e.g. ones the aggregator excluded, are kept), a WEIGHT_DIFF result is added to them.

    WEIGHTS may be lazy (refs are kept as they are, so a relay forwards a site's model without
    reading it); a WEIGHT_DIFF and the model it is added to must be materialized.
    """

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
                    _same_shape(name, value, data[name])
                data[name] = value
        elif dxo.data_kind is DataKind.WEIGHT_DIFF:
            if dxo.is_lazy or model.is_lazy:
                raise InvalidArgument("a WEIGHT_DIFF and the model it updates must be "
                                      "materialized", field="data")
            for name, diff in dxo.data.items():
                if name not in data:
                    raise InvalidArgument(f"the diff names {name!r}, which the model lacks",
                                          field=name)
                _same_shape(name, diff, data[name])
                data[name] = _add(data[name], diff)
        else:
            raise InvalidArgument(f"a {dxo.data_kind.value} DXO cannot update the model",
                                  field="data_kind")
        return Dxo(DataKind.WEIGHTS, data, dict(model.meta))


def _same_shape(name: str, new: Any, old: Any) -> None:
    if tuple(new.shape) != tuple(old.shape):
        raise InvalidArgument(f"{name!r} has shape {tuple(new.shape)}, the model's is "
                              f"{tuple(old.shape)}", field=name)


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
