"""The quickstart's worker function in Ray actors: Ray places them, asyncsync moves the weights.

    pip install torch==2.13.0 -e '.[ray]'
    python examples/ray_workers.py                         # a local Ray instance
    python examples/ray_workers.py --address auto          # the Ray cluster this node belongs to
    python examples/ray_workers.py --nodes                 # two Ray nodes on this machine
    python examples/ray_workers.py --nodes --address auto  # every node of the cluster

Each actor runs the quickstart's ``rollout_worker`` (the function ``spawn_workers`` runs
there), unchanged, in its event loop. By default every actor is on this node and attaches
to the trainer by address: every update goes through shared memory. With ``--nodes`` each
Ray node runs ``--workers`` actors and one relay actor, which receives each update once
over the network (``DistributedWeightSyncScheme``) and hands it to that node's actors
through its shared memory. Ray's object store carries no weights either way.

What the actors print stays in Ray's log files (``/tmp/ray/session_latest/logs/worker-*``),
not on this console: with ``--nodes``, a relay that joins while the group re-forms for the
other node logs a rendezvous it gave up (torch's gloo prints an error line for it), which
is part of a normal start. An actor that fails is reported here, by the call that needed it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import quickstart  # examples/quickstart.py, next to this file
import ray
import torch
from torch import nn

from asyncsync import DistributedWeightSyncScheme, MultiProcessWeightSyncScheme
from asyncsync.ray import start_workers

# The actors cannot import this folder's modules: the quickstart's functions travel by value.
ray.cloudpickle.register_pickle_by_value(quickstart)
make_policy, rollout_worker = quickstart.make_policy, quickstart.rollout_worker


async def train(policy: nn.Module, scheme: MultiProcessWeightSyncScheme | DistributedWeightSyncScheme, steps: int) -> None:
    optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
    async with scheme:  # waits for every actor to attach and apply version 0
        for step in range(steps):
            loss = policy(torch.randn(64, 8)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            t0 = time.perf_counter()
            version = await scheme.send()
            print(f"step {step}: version {version} applied by every actor in {(time.perf_counter() - t0) * 1e3:.2f} ms")


async def on_this_node(num_workers: int, steps: int) -> None:
    policy = make_policy()
    scheme = MultiProcessWeightSyncScheme(timeout=120)
    scheme.init_on_sender(model=policy, num_workers=num_workers)
    async with start_workers(rollout_worker, scheme, num_workers=num_workers, actor_options={"num_cpus": 1}) as group:
        print(f"actors started: pids {group.pids}")
        await train(policy, scheme, steps)
    print(f"results: {group.results}")


async def on_every_node(workers_per_node: int, steps: int) -> None:
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]  # host h runs on nodes[h - 1]
    policy = make_policy()
    # The relays on the other nodes reach the trainer at the address Ray knows this node by.
    scheme = DistributedWeightSyncScheme(timeout=120, master_addr=ray.util.get_node_ip_address())
    scheme.init_on_sender(model=policy, hosts={h: workers_per_node for h in range(1, len(nodes) + 1)})
    async with start_workers(rollout_worker, scheme, nodes=nodes, actor_options={"num_cpus": 1}) as group:
        print(f"{len(nodes)} nodes: relays {group.relay_pids}, workers {group.pids}")
        await train(policy, scheme, steps)
    print(f"results: {group.results}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: start a local instance)")
    parser.add_argument("--nodes", action="store_true", help="workers on every Ray node, through one relay actor per node")
    parser.add_argument("--workers", type=int, default=2, help="actors in all, or per node with --nodes")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cluster = None
    if args.address is not None:
        ray.init(address=args.address, log_to_driver=False)
    elif args.nodes:  # two raylets on this machine, each a Ray node of its own
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.workers, "include_dashboard": False})
        cluster.add_node(num_cpus=args.workers)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    else:
        ray.init(num_cpus=max(2, args.workers), include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(on_every_node(args.workers, args.steps) if args.nodes else on_this_node(args.workers, args.steps))
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
