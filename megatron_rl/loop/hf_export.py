"""checkpoint.save_hf_every: the trainer's weights as an HF folder during the run (log.dir/hf/step_XXXXXX).

Every rank runs the export (the TP all-gathers are collective); the first rank of each pipeline
stage in data-parallel replica 0 holds its stage's full tensors, which are gathered to rank 0
over the pipeline group of rank 0, and rank 0 writes the folder atomically (convert/hf_export.py).
Hazard: rank 0 holds the whole model in host memory while it writes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_rl import collectives
from megatron_rl.convert.hf_export import write_hf_folder

log = logging.getLogger("megatron_rl.loop.hf_export")


def hf_export_dir(log_dir: str | Path, step: int) -> Path:
    return Path(log_dir) / "hf" / f"step_{step:06d}"


def export_hf(actor, parallel, side_dir: str | Path, out_dir: str | Path) -> Path | None:
    """Collective over the world: write `out_dir` on rank 0 (returned there; None elsewhere)."""
    stage = {name: t.detach().cpu().clone() for name, t in actor.export_hf_weights()}
    stages = None
    if parallel.tp_rank == 0 and parallel.dp_rank == 0:  # exactly the members of rank 0's PP group
        stages = collectives.gather_objects(stage, 0, parallel.pp_group)
    written = None
    if parallel.rank == 0:
        merged = {name: t for part in stages for name, t in part.items()}
        written = write_hf_folder(out_dir, merged, side_dir)
        log.info("HF export written: %s", written)
    collectives.barrier(None)  # no rank runs ahead of a folder that is not there yet
    return written
