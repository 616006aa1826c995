"""Model persistors: where a workflow's global model starts and where the final one is kept.

    model = persistor.load(ctx)            # Dxo(WEIGHTS): refs in a server job, else arrays
    persistor.save(ctx, model, round)      # <workspace>/<final_file>: part of the job result

`load` returns the model last saved in this job's workspace when there is one (so a later
workflow, cross-site evaluation say, sees the trained model), else the initial model. In a
server job (a context with a blob store) the model comes back as refs: each array is stored
at its content key as soon as it is read or made, and dropped, so the server never holds the
whole model. `save` takes a model of refs or arrays and writes the file tensor by tensor (a
ref is read, written, dropped). The global model of every round is also checkpointed to S3 by
the workflows (`fl.checkpoint`).

A persistor of its own (in a job's custom code) subclasses `ModelPersistor` and defines
`_initial_items` (yield (name, array) one at a time: a generated model is never whole in
memory), `_read_items` and `_write_items`.
"""

from __future__ import annotations

import abc
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from fedhive import extras
from fedhive.blobs import TensorKind, TensorRef, unpack
from fedhive.blobs.dtypes import is_torch_tensor, torch_to_bytes
from fedhive.errors import FailedPrecondition, InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.model_store import ModelStore

if TYPE_CHECKING:
    from fedhive.fl.workflow import WorkflowContext

Items = Iterator[tuple[str, Any]]


class ModelPersistor(abc.ABC):
    kind: TensorKind = TensorKind.NUMPY  # what the arrays `save` writes are read as

    def __init__(self, final_file: str) -> None:
        path = PurePosixPath(final_file) if isinstance(final_file, str) else None
        if path is None or not final_file or path.is_absolute() or ".." in path.parts:
            raise InvalidArgument(f"final_file must be a relative file name inside the "
                                  f"workspace, not {final_file!r}", field="final_file")
        self.final_file = final_file

    def final_path(self, ctx: WorkflowContext) -> Path:
        return ctx.workspace / self.final_file

    def load(self, ctx: WorkflowContext) -> Dxo:
        """The last model saved in this workspace, else the initial one: refs when `ctx` has a
        blob store (a server job), else arrays."""
        path = self.final_path(ctx)
        saved = path.is_file()
        items = self._read_items(path) if saved else self._initial_items()
        if ctx.store is not None and ctx.codec is not None and ctx.names is not None:
            model = ModelStore.of(ctx).pack(items)
        else:
            model = Dxo(DataKind.WEIGHTS, dict(items))
        ctx.log.info("persistor.loaded", file=str(path) if saved else "",
                     arrays=len(model.data))
        return model

    def save(self, ctx: WorkflowContext, model: Dxo, round_: int) -> Path:
        """Write `model` (refs or arrays) to the workspace, one tensor at a time, atomically;
        returns the file."""
        if model.is_lazy and ctx.store is None:
            raise InvalidArgument("the model must be materialized before it is saved (no "
                                  "blob store to read its refs from)", field="data")
        self._check(model)
        path = self.final_path(ctx)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        try:
            self._write_items(partial, self._values(ctx, model))
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, path)
        ctx.log.info("persistor.saved", file=str(path), round=round_)
        return path

    def _values(self, ctx: WorkflowContext, model: Dxo) -> Items:
        """(name, array) of `model`, refs read one at a time (checksums verified)."""
        for name, value in model.data.items():
            if isinstance(value, TensorRef):
                if ctx.store is None:
                    raise FailedPrecondition("the workflow context has no blob store",
                                             field="store")
                yield name, unpack([value], ctx.store, kind=self.kind)[name]
            else:
                yield name, value

    def _check(self, model: Dxo) -> None:
        """Raise before anything is written when `model` cannot be saved (names, shapes)."""
        return None

    @abc.abstractmethod
    def _initial_items(self) -> Items: ...

    @abc.abstractmethod
    def _read_items(self, path: Path) -> Items: ...

    @abc.abstractmethod
    def _write_items(self, path: Path, items: Items) -> None: ...


class NumpyModelPersistor(ModelPersistor):
    """A model of numpy arrays: `initial` {name: number or nested list} in `dtype`; the final
    model is an .npz file (written member by member; a bfloat16 tensor is kept as its uint16
    bits, numpy having no bfloat16)."""

    def __init__(self, initial: dict[str, Any] | None = None, dtype: str = "float32",
                 final_file: str = "model.npz") -> None:
        super().__init__(final_file)
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise InvalidArgument(f"dtype {dtype!r} is not a numpy dtype", field="dtype") from None
        if initial is not None and not isinstance(initial, dict):
            raise InvalidArgument("initial must map array names to (nested lists of) numbers",
                                  field="initial")
        self.initial: dict[str, np.ndarray[Any, Any]] = {}
        for name, value in (initial or {}).items():
            try:
                self.initial[name] = np.asarray(value, dtype=self.dtype)
            except (TypeError, ValueError) as err:
                raise InvalidArgument(f"initial[{name!r}] is not an array of numbers: {err}",
                                      field="initial") from None

    def _initial_items(self) -> Items:
        for name, array in self.initial.items():
            yield name, array.copy()

    def _read_items(self, path: Path) -> Items:
        with np.load(path, allow_pickle=False) as saved:  # members are read when asked for
            for name in saved.files:
                yield name, saved[name]

    def _write_items(self, path: Path, items: Items) -> None:
        # np.savez's format (a zip of .npy members, stored), one member at a time.
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, value in items:
                array = _to_numpy(value)
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
                del array, value


def _to_numpy(value: Any) -> np.ndarray[Any, Any]:
    if is_torch_tensor(value):
        flat, dtype = torch_to_bytes("", value)
        storage = flat.view("<u2" if dtype == "bfloat16" else np.dtype(dtype))
        return storage.reshape(tuple(int(d) for d in value.shape))
    return np.asarray(value)


class TorchModelPersistor(ModelPersistor):
    """A torch.nn.Module (config: `{"path": "my_net.Net", "args": {...}}`, built before this
    persistor); the model is its state dict, the final model a `torch.save`d state dict.

    The module holds the model (as FLARE's PTFileModelPersistor does): `save` copies each
    tensor into the module's own state as it is read (checked first against the module's
    names and shapes), then saves that state, so no second copy of the model is ever made;
    `load` yields one tensor at a time and reads a saved file memory-mapped.
    """

    kind = TensorKind.TORCH

    def __init__(self, model: Any, final_file: str = "model.pt") -> None:
        super().__init__(final_file)
        extras.require("the PyTorch persistor", "torch")
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module (a {{path, args}} object), "
                                  f"not a {type(model).__name__}", field="model")
        self.model = model

    def _initial_items(self) -> Items:
        for name, value in self.model.state_dict().items():
            yield name, value.detach().cpu().clone()

    def _read_items(self, path: Path) -> Items:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        self.model.load_state_dict(state)
        del state
        yield from self._initial_items()

    def _check(self, model: Dxo) -> None:
        state = self.model.state_dict()
        missing = sorted(set(state) - set(model.data))
        unexpected = sorted(set(model.data) - set(state))
        if missing or unexpected:
            raise InvalidArgument(f"the model does not fit the module: missing {missing}, "
                                  f"unexpected {unexpected}", field="model")
        for name, value in model.data.items():
            if tuple(value.shape) != tuple(state[name].shape):
                raise InvalidArgument(f"tensor {name!r} has shape {tuple(value.shape)}, the "
                                      f"module's is {tuple(state[name].shape)}", field=name)

    def _write_items(self, path: Path, items: Items) -> None:
        import torch

        state = self.model.state_dict()
        with torch.no_grad():
            for name, value in items:
                if not is_torch_tensor(value):
                    value = torch.from_numpy(np.require(value, requirements=["C", "W"]))
                state[name].copy_(value)
                del value
        torch.save(state, path)
