"""A Megatron checkpoint's tensors as views of its files, for a model that is only written out again
(``roll-convert mca2hf``), and the writer's layout that makes that possible.

Each stored tensor of a ``torch_dist`` checkpoint is a ``torch.save`` archive at an offset of a ``.distcp`` file
(``checkpoint_io``). ``torch.save`` puts a tensor's bytes at a multiple of 64 bytes from the archive's start, so
when the archive itself starts at a multiple of 64 (``aligning_archives``: roll's writer pads before each one;
PyTorch's and Megatron's readers never read between archives), every stored tensor is aligned in its file and a
parameter stored whole can be a view of a private map of the file instead of a read into fresh memory
(``MappedParams``). Then ``safetensors_io.write_file`` copies its bytes file to file. A checkpoint written before
(archives 1-byte aligned) maps the tensors that happen to be aligned and reads the others, as before.
"""

from __future__ import annotations

import contextlib

import torch

from backends.mca.models.safetensors_io import private_map

ALIGNMENT = 64  # torch.save's own alignment of a tensor's bytes inside its archive


def aligning_archives(create_stream):
    """PyTorch's ``FileSystem.create_stream`` whose write streams start each item at a multiple of ``ALIGNMENT``."""

    @contextlib.contextmanager
    def create(path, mode: str):
        with create_stream(path, mode) as stream:
            yield _AligningStream(stream) if "w" in mode else stream

    return create


class _AligningStream:
    """A write stream that pads with zeros to a multiple of ``ALIGNMENT`` when asked where it is twice with no write
    in between: PyTorch's writer asks (``tell``) before each item and after it (``_write_item``, torch 2.13), so the
    padding lands before every item but the first (already at 0), outside every item's recorded bytes."""

    def __init__(self, stream) -> None:
        self._stream, self._wrote = stream, True

    def write(self, data) -> int:
        self._wrote = True
        return self._stream.write(data)

    def tell(self) -> int:
        at = self._stream.tell()
        if not self._wrote and at % ALIGNMENT:
            at += self._stream.write(bytes(-at % ALIGNMENT))
        self._wrote = False
        return at

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class MappedParams:
    """The parameters of ``chunks`` a checkpoint load may serve from private maps of the checkpoint's files: in
    ``checkpoint_io``'s reader, a request whose destination is a whole parameter and whose source the whole stored
    tensor, aligned in its file, is ``take``n (nothing read); ``apply``, after Megatron's ``load_state_dict``, makes
    each taken parameter a view of its map. Until then a taken parameter holds no data: only for a model that is
    loaded to be written out again (``roll-convert mca2hf``). A write to a mapped parameter copies the page it
    touches (private map), never the file; the writer copies the file's bytes, so it must not be written to."""

    def __init__(self, chunks) -> None:
        self._params = {param.data_ptr(): param for chunk in chunks for param in chunk.parameters()
                        if param.device.type == "cpu" and param.is_contiguous() and param.numel()}
        self._maps: dict[str, object] = {}
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.nbytes = 0

    def take(self, fd: int, path: str, position: int, target: torch.Tensor) -> bool:
        """Whether ``target`` (the whole stored tensor's destination, its bytes at ``position`` of file ``fd``, named
        ``path``) is a whole parameter that will be served from the file's map."""
        param = self._params.get(target.data_ptr())
        if (param is None or param.dtype != target.dtype or param.nbytes != target.nbytes
                or position % target.element_size()):
            return False
        if path not in self._maps:
            self._maps[path] = private_map(fd)
        view = torch.frombuffer(self._maps[path], dtype=param.dtype, count=param.numel(), offset=position)
        self._views.append((param, view.view(param.shape)))
        self.nbytes += param.nbytes
        return True

    def apply(self) -> None:
        """Point every taken parameter at its file's map (its own, never-touched memory is freed)."""
        for param, view in self._views:
            param.data = view
        self._views.clear()
