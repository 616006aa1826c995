"""Model persistors: where a workflow's global model starts and where the final one is kept.

    model = persistor.load(ctx)            # Dxo(WEIGHTS, arrays)
    persistor.save(ctx, model, round)      # <workspace>/<final_file>: part of the job result

`load` returns the model last saved in this job's workspace when there is one (so a later
workflow, cross-site evaluation say, sees the trained model), else the initial model. The
global model of every round is also checkpointed to S3 by the workflows (`fl.checkpoint`).
"""

from __future__ import annotations

import abc
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from fedhive.blobs.dtypes import is_torch_tensor
from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo

if TYPE_CHECKING:
    from fedhive.fl.workflow import WorkflowContext


class ModelPersistor(abc.ABC):
    def __init__(self, final_file: str) -> None:
        path = PurePosixPath(final_file) if isinstance(final_file, str) else None
        if path is None or not final_file or path.is_absolute() or ".." in path.parts:
            raise InvalidArgument(f"final_file must be a relative file name inside the "
                                  f"workspace, not {final_file!r}", field="final_file")
        self.final_file = final_file

    def final_path(self, ctx: WorkflowContext) -> Path:
        return ctx.workspace / self.final_file

    def load(self, ctx: WorkflowContext) -> Dxo:
        """The last model saved in this workspace, else the initial one."""
        path = self.final_path(ctx)
        arrays = self._read(path) if path.is_file() else self._initial()
        ctx.log.info("persistor.loaded", file=str(path) if path.is_file() else "",
                     arrays=len(arrays))
        return Dxo(DataKind.WEIGHTS, arrays)

    def save(self, ctx: WorkflowContext, model: Dxo, round_: int) -> Path:
        """Write `model` (materialized) to the workspace, atomically; returns the file."""
        if model.is_lazy:
            raise InvalidArgument("the model must be materialized before it is saved",
                                  field="data")
        path = self.final_path(ctx)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        self._write(partial, model.data)
        os.replace(partial, path)
        ctx.log.info("persistor.saved", file=str(path), round=round_)
        return path

    @abc.abstractmethod
    def _initial(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _read(self, path: Path) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _write(self, path: Path, arrays: dict[str, Any]) -> None: ...


class NumpyModelPersistor(ModelPersistor):
    """A model of numpy arrays: `initial` {name: number or nested list} in `dtype`; the final
    model is an .npz file."""

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

    def _initial(self) -> dict[str, Any]:
        return {name: array.copy() for name, array in self.initial.items()}

    def _read(self, path: Path) -> dict[str, Any]:
        with np.load(path, allow_pickle=False) as saved:
            return {name: saved[name] for name in saved.files}

    def _write(self, path: Path, arrays: dict[str, Any]) -> None:
        with path.open("wb") as out:
            arrays_out: dict[str, Any] = {name: _to_numpy(value) for name, value in arrays.items()}
            np.savez(out, **arrays_out)


def _to_numpy(value: Any) -> np.ndarray[Any, Any]:
    return value.detach().cpu().numpy() if is_torch_tensor(value) else np.asarray(value)


class TorchModelPersistor(ModelPersistor):
    """A torch.nn.Module (config: `{"path": "my_net.Net", "args": {...}}`, built before this
    persistor); the model is its state dict, the final model a `torch.save`d state dict."""

    def __init__(self, model: Any, final_file: str = "model.pt") -> None:
        super().__init__(final_file)
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module (a {{path, args}} object), "
                                  f"not a {type(model).__name__}", field="model")
        self.model = model

    def _initial(self) -> dict[str, Any]:
        return {name: value.detach().cpu().clone()
                for name, value in self.model.state_dict().items()}

    def _read(self, path: Path) -> dict[str, Any]:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state)
        return dict(state)

    def _write(self, path: Path, arrays: dict[str, Any]) -> None:
        import torch

        # Through the module, so a model that does not fit it fails here, not at reuse.
        state = {name: value if is_torch_tensor(value) else torch.tensor(np.asarray(value))
                 for name, value in arrays.items()}
        self.model.load_state_dict(state)
        torch.save(self.model.state_dict(), path)
