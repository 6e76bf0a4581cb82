"""Compat patches to how Megatron-Core (and PyTorch's distributed checkpoint under it) reads a checkpoint:
unpickling restricted to an allow-list (``restricted_checkpoint_reads``, about trust, not the platform) and
the distributed optimizer's AdamW ``step`` on resume without TE/Apex (``distopt_step_on_load``).
``backends.mca.platform.apply_patches`` applies them with the others, from its one table (which says when
each is needed and when it can go). Process-wide and permanent once applied: never in a test runner's own
process."""

from __future__ import annotations

import os
import pickle

from roll import unpickle


def patch_restricted_checkpoint_reads() -> None:
    """A checkpoint from elsewhere could run code when read: PyTorch's distributed-checkpoint reader unpickles
    ``.metadata`` with ``pickle.load`` and the bytes entries of ``.distcp`` files (``_extra_state``) with
    ``torch.load(weights_only=False)``; megatron-core reads ``common.pt`` and sharded objects with
    ``torch.load`` and names no file when that refuses. All go through ``roll.unpickle`` (its allow-list
    unless ``trust_checkpoint_pickles``), which names the file. Applied everywhere (not a platform bug); can
    go when torch DCP reads both with an allow-list of its own (not as of torch 2.13)."""
    from megatron.core.dist_checkpointing.strategies import common
    from torch.distributed.checkpoint import default_planner, filesystem, metadata

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            loaded = unpickle.load_pickle(fh, str(path))
        if getattr(loaded, "storage_meta", None) is None:
            loaded.storage_meta = metadata.StorageMeta()
        loaded.storage_meta.load_id = self.load_id
        return loaded

    def load_bytes(self, read_item, value):
        where = self.metadata.storage_data[read_item.storage_index].relative_path
        loaded = unpickle.torch_load(value, f"{where} (entry {read_item.dest_index.fqn})")  # relative path
        if self.flatten_state_dict:
            fqn = read_item.dest_index.fqn
            default_planner.set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    original_common, original_objects = (common.TorchCommonLoadStrategy.load_common,
                                          common.TorchCommonLoadStrategy.load_sharded_objects)

    def load_common(self, checkpoint_dir):
        path = os.path.join(checkpoint_dir, common.COMMON_STATE_FNAME)
        if not os.path.isfile(path):
            return original_common(self, checkpoint_dir)  # megatron's own "does not exist" message
        return unpickle.torch_load(path, map_location="cpu")

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        try:
            return original_objects(self, sharded_objects_state_dict, checkpoint_dir)
        except pickle.UnpicklingError as exc:
            raise unpickle.refusal(f"a sharded-object file (*.pt) in {checkpoint_dir}", exc) from None

    filesystem.FileSystemReader.read_metadata = read_metadata
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    common.TorchCommonLoadStrategy.load_common = load_common
    common.TorchCommonLoadStrategy.load_sharded_objects = load_sharded_objects


def patch_distopt_step_on_load() -> None:
    """Resuming the distributed optimizer from a ``fully_reshardable`` checkpoint with torch's AdamW
    (no TE/Apex) fails with ``KeyError: 'step'`` in megatron-core 0.16.1: the loader restores AdamW's
    per-parameter ``step`` from the param groups and leaves it out of the tensors it hands to
    ``_set_main_param_and_optimizer_states``, which then copies every destination key, ``step``
    included. And the restored ``step`` is one tensor shared by every parameter, which AdamW's
    foreach update then increments once per parameter. Give each parameter its own copy and hand
    it to that method (copied onto itself)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                state["step"] = state["step"].detach().clone()
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
