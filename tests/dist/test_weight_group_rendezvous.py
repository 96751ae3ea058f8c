"""The trainer's side of the SGLang weight-update group, created inside a torchrun worker.

torchrun sets TORCHELASTIC_USE_AGENT_STORE=True in its workers; torch's tcp:// rendezvous then makes
every rank, rank 0 included, a client of a store the agent is supposed to host. The weight group's
store is not the agent's, so rank 0 must start it itself, or rank 0 and the servers wait forever.
Rank 1 joins as SGLang's init_custom_process_group does (rendezvous on tcp://addr:port, store
prefixed by the group name), outside torchrun.
"""

from __future__ import annotations

import datetime

import torch

from _launch import free_port, run_distributed

GROUP = "megatron_rl_weights_0"


def _worker(rank: int, world_size: int, port: int):
    import os

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    from megatron_rl import collectives

    timeout = datetime.timedelta(seconds=20)
    if rank == 0:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as inside a torchrun worker
        group = collectives.rendezvous_group_as_rank0("127.0.0.1", port, 2, GROUP, "gloo", timeout)
        # registered with torch like any group of its own world: its ranks translate
        assert torch.distributed.get_process_group_ranks(group) == [0, 1]
        sent = collectives.broadcast(torch.arange(6, dtype=torch.float32), group_src=0, group=group)
        collectives.destroy_group(group)  # the weight group alone: there is no default group here
        return sent
    # the server side, as sglang/srt/utils init_custom_process_group builds it
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    group, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore(GROUP, store),
                                         group_name=GROUP, backend_options=None, timeout=timeout)
    payload = torch.zeros(6)
    torch.distributed.broadcast(payload, group_src=0, group=group)
    return payload


def test_weight_group_forms_inside_a_torchrun_worker():
    got = run_distributed(_worker, world_size=2, args=(free_port(),), timeout_s=120)
    assert [t.tolist() for t in got] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]] * 2
