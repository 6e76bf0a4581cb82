"""This machine's floor for a conversion of one file: what reading and writing its bytes cost, without roll.

    python scripts/disk_floor.py outputs/bench/model/model.safetensors --work-dir /tmp/disk-floor --repeat 3

Times (best of ``--repeat``; wall and CPU seconds of this process, GB/s of the file's size):
- reading it with ``preadv`` from a warm page cache into fresh memory (a new tensor: every page faults in, as
  a newly built model's parameters do) and into memory already touched; from a cold cache likewise (the
  file's pages evicted first with ``posix_fadvise(DONTNEED)``: only this file's, nothing else's);
- writing the same bytes to a new file, without and with ``fsync``; the kernel copying the file
  (``copy_file_range``: no user memory at all); writing a new file from a private memory map of the source
  (what ``roll-convert hf2mca`` does for the parameters it maps);
- the raw copy: read into fresh memory, then write a new file (``roll-bench``'s *raw copy* row).
Run it on an idle machine: under load every number is the scheduler's.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", help="a large file, e.g. a model's .safetensors")
    parser.add_argument("--work-dir", default="outputs/disk-floor", help="where the written copies go (deleted)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    src, size = args.file, os.path.getsize(args.file)
    os.makedirs(args.work_dir, exist_ok=True)
    out = os.path.join(args.work_dir, "copy.bin")
    touched = torch.ones(size, dtype=torch.uint8).numpy()

    def read_into(buf) -> None:
        fd, view, done = os.open(src, os.O_RDONLY), memoryview(buf), 0
        try:
            while done < size:
                done += os.preadv(fd, [view[done:done + (1 << 30)]], done)
        finally:
            os.close(fd)

    def evict() -> None:
        fd = os.open(src, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def write(buf, sync: bool = False) -> None:
        if os.path.exists(out):
            os.unlink(out)
        fd, view, done = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), memoryview(buf), 0
        try:
            while done < size:
                done += os.write(fd, view[done:done + (1 << 30)])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def kernel_copy() -> None:
        if os.path.exists(out):
            os.unlink(out)
        fd_in, fd_out, done = os.open(src, os.O_RDONLY), os.open(out, os.O_WRONLY | os.O_CREAT, 0o644), 0
        try:
            while done < size:
                done += os.copy_file_range(fd_in, fd_out, size - done)
        finally:
            os.close(fd_in)
            os.close(fd_out)

    def from_map() -> None:
        with open(src, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            write(mapped)
        finally:
            mapped.close()

    def fresh():
        return torch.empty(size, dtype=torch.uint8).numpy()

    def raw_copy() -> None:
        buf = fresh()
        read_into(buf)
        write(buf)

    cases = [("read warm -> fresh memory", lambda: read_into(fresh())),
             ("read warm -> touched memory", lambda: read_into(touched)),
             ("read cold -> fresh memory", lambda: (evict(), read_into(fresh()))),
             ("read cold -> touched memory", lambda: (evict(), read_into(touched))),
             ("write a new file (no fsync)", lambda: write(touched)),
             ("write a new file + fsync", lambda: write(touched, sync=True)),
             ("copy_file_range (kernel copy, warm)", kernel_copy),
             ("write a new file from a private map of the source", from_map),
             ("raw copy: read warm -> fresh memory, write a new file", raw_copy)]
    print(f"{src}: {size / 1e9:.3f} GB, load average {os.getloadavg()[0]:.1f}")
    for name, fn in cases:
        best = None
        for _ in range(args.repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            took = (time.perf_counter() - wall, time.process_time() - cpu)
            best = took if best is None or took[0] < best[0] else best
        print(f"{name:55s} {best[0]:6.3f} s  {size / 1e9 / best[0]:5.2f} GB/s  CPU {best[1]:.3f} s", flush=True)
    if os.path.exists(out):
        os.unlink(out)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
