"""A Megatron checkpoint's tensors as views of its files, for a model that is only written out again
(``roll-convert mca2hf``), and the writer's layout that makes that possible.

Each stored tensor of a ``torch_dist`` checkpoint is a ``torch.save`` archive at an offset of a ``.distcp`` file
(``checkpoint_io``). ``torch.save`` puts a tensor's bytes at a multiple of 64 bytes from the archive's start, so
when the archive itself starts at a multiple of 64 (``aligning_archives``: roll's writer pads before each one;
PyTorch's and Megatron's readers never read between archives), every stored tensor is aligned in its file and a
parameter stored whole can be a view of a private map of the file instead of a read into fresh memory
(``MappedParams``). Then ``safetensors_io.write_file`` copies its bytes file to file. The fused gate/up weight,
stored as two archives (one per half), cannot be one view; in a process of its own it is left unread, each half
recorded as a span of its archive, and copied from there (each half is one HF tensor). A checkpoint written before
(archives 1-byte aligned) maps the tensors that happen to be aligned and reads the others, as before.
"""

from __future__ import annotations

import bisect
import warnings

import torch

from backends.mca.models.safetensors_io import file_backed, private_map, unread_memory, wrapping_write_streams

ALIGNMENT = 64  # torch.save's own alignment of a tensor's bytes inside its archive


def aligning_archives(create_stream):
    """PyTorch's ``FileSystem.create_stream`` whose write streams start each item at a multiple of ``ALIGNMENT``."""
    return wrapping_write_streams(create_stream, _AligningStream)


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
    """The parameters of ``chunks`` a checkpoint load may serve from the checkpoint's files: in ``checkpoint_io``'s
    reader, a request whose destination is the whole stored tensor, aligned in its file, is ``take``n (nothing
    read) when that destination is a whole parameter, or (in a process of its own: nothing is gathered from its
    memory) a block of one (the fused gate/up weight, stored as its two halves); ``apply``, after Megatron's
    ``load_state_dict``, makes each whole one a view of its file's private map, and each parameter its blocks tile
    a view of ``unread_memory`` whose spans ``file_backed`` records: ``write_file`` copies each half (one HF
    tensor, gate_proj or up_proj) from its archive, and any other read of that memory is a crash, never wrong
    bytes. Until ``apply`` a taken parameter holds no data: only for a model that is loaded to be written out
    again (``roll-convert mca2hf``). A write to a mapped parameter copies the page it touches (private map), never
    the file; the writer copies the file's bytes, so it must not be written to."""

    def __init__(self, chunks) -> None:
        import torch.distributed as dist

        self._params = {param.data_ptr(): param for chunk in chunks for param in chunk.parameters()
                        if param.device.type == "cpu" and param.is_contiguous() and param.numel()}
        # the fused gate/up weights: the only parameters whose two stored halves (a checkpoint saved at TP1) are
        # each one HF tensor the exporter takes whole; any other tiling (saved at TP2: four blocks, or a non-gated
        # weight's halves) is copied from the maps, since the export reads it (splits, concatenations)
        self._gate_up = {id(param) for chunk in chunks for name, param in chunk.named_parameters()
                         if name.endswith("linear_fc1.weight")
                         and getattr(getattr(chunk, "config", None), "gated_linear_unit", False)}
        self._starts = sorted(self._params)
        self._alone = not dist.is_initialized() or dist.get_world_size() == 1
        self._maps: dict[str, object] = {}
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._blocks: dict[int, tuple[torch.nn.Parameter, list[tuple[int, int, object, int]]]] = {}
        self.nbytes = 0

    def take(self, fd: int, path: str, position: int, target: torch.Tensor) -> bool:
        """Whether ``target`` (the whole stored tensor's destination, its bytes at ``position`` of file ``fd``, named
        ``path``) is a whole parameter, or a block of one, that will be served from the file."""
        param = self._params.get(target.data_ptr())
        if param is not None and param.nbytes == target.nbytes:
            if param.dtype != target.dtype or position % target.element_size():
                return False
            view = torch.frombuffer(self._map(fd, path), dtype=param.dtype, count=param.numel(), offset=position)
            self._views.append((param, view.view(param.shape)))
        else:
            param = self._containing(target)
            if param is None or not self._alone or param.dtype != target.dtype or not target.is_contiguous():
                return False
            begin = target.data_ptr() - param.data_ptr()
            self._blocks.setdefault(id(param), (param, []))[1].append((begin, target.nbytes, self._map(fd, path),
                                                                       position))
        self.nbytes += target.nbytes
        return True

    def _map(self, fd: int, path: str):
        if path not in self._maps:
            self._maps[path] = private_map(fd)
        return self._maps[path]

    def _containing(self, target: torch.Tensor) -> torch.nn.Parameter | None:
        at = bisect.bisect_right(self._starts, target.data_ptr()) - 1
        param = self._params[self._starts[at]] if at >= 0 else None
        if param is None or target.data_ptr() + target.nbytes > param.data_ptr() + param.nbytes:
            return None
        return param

    def apply(self) -> None:
        """Point every taken parameter at its file's map, or at unread memory its blocks' files back (its own,
        never-touched memory is freed); a parameter only partly taken gets its taken blocks copied from the maps."""
        for param, view in self._views:
            param.data = view
        self._views.clear()
        for param, blocks in self._blocks.values():
            blocks.sort(key=lambda block: block[0])
            ends = [0] + [begin + nbytes for begin, nbytes, *_ in blocks]
            halves = len(blocks) == 2 and blocks[0][1] == blocks[1][1] and id(param) in self._gate_up
            if halves and [begin for begin, *_ in blocks] == ends[:-1] and ends[-1] == param.nbytes:  # gate, up
                memory = unread_memory(param.nbytes)
                for begin, nbytes, source, position in blocks:
                    file_backed(memory, begin, nbytes, source, position)
                with warnings.catch_warnings():  # no access at all: a read-only buffer to Python
                    warnings.simplefilter("ignore", UserWarning)
                    param.data = torch.frombuffer(memory, dtype=param.dtype, count=param.numel()).view(param.shape)
            else:
                flat = param.data.view(-1).view(torch.uint8)
                for begin, nbytes, source, position in blocks:
                    flat[begin:begin + nbytes].copy_(torch.frombuffer(source, dtype=torch.uint8, count=nbytes,
                                                                      offset=position))
        self._blocks.clear()
