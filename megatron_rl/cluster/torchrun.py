"""torchrun whose first node keeps the rendezvous store up until every node has left: a multi-node
job that succeeds ends without a traceback on any node.

torchrun's static rendezvous serves its TCPStore from node rank 0's agent. At the end every agent
waits in an exit barrier on that store (torch/distributed/elastic/agent/server/api.py,
`_exit_barrier`; utils/store.py, `barrier`: add to a counter, the last one sets a key, all wait
for it). Node 0 leaves as soon as the key is set; an agent that still has its `wait` to send or
read then fails with "Error waiting on exit barrier ... DistNetworkError: Failed to recv". Here
node 0 opens the same store server first (TCPStore `multi_tenant`: the agent's store in this
process reuses it), and holds it after torchrun returns until every other node's launcher has
checked in after its own torchrun returned, i.e. after its barrier.

    python -m megatron_rl.cluster.torchrun [torchrun arguments]   # as python -m torch.distributed.run
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record

log = logging.getLogger("megatron_rl.cluster.torchrun")

DEPARTED = "megatron_rl/departed"
DEPART_TIMEOUT_S = 60.0  # how long node 0 waits for the others after a success


def _nodes(args) -> int:
    return int(str(args.nnodes).rpartition(":")[2])


def _store(args, host: bool, timeout_s: float) -> TCPStore:
    return TCPStore(args.master_addr, int(args.master_port or 29500), is_master=host, multi_tenant=True,
                    wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    multi = args.rdzv_backend == "static" and _nodes(args) > 1
    host = multi and args.node_rank == 0
    store = _store(args, True, DEPART_TIMEOUT_S) if host else None  # before torchrun binds the port
    torchrun.run(args)  # raises on a failed worker (and on SIGTERM): no ordered exit needed then
    if host:
        deadline = time.monotonic() + DEPART_TIMEOUT_S
        while store.add(DEPARTED, 0) < _nodes(args) - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    elif multi:
        try:
            _store(args, False, 10.0).add(DEPARTED, 1)
        except Exception as err:  # noqa: BLE001 - node 0 gone already: nothing left to order
            log.warning("could not check out with node 0 (%s)", err)


if __name__ == "__main__":
    main()
