"""The DDP hook on several nodes of several ranks each (run.sh launches 2 x 2 on this host:
two torchrun with ``--nnodes 2``): the state sees which ranks share a node, and its exchanges
take the hierarchical plans, bit for bit as mean_estimate with that topology (the other DDP
tests check every codec that way); on one node nothing changes."""
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.exchange import plans
from horovod_quant.torch import ddp

from conftest import gather_rows


def test_nodes_of_several_ranks_take_the_hierarchical_plans():
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 64)))
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8))
    model.register_comm_hook(state, ddp.quantization_hook)
    nodes = [int(n) for n in gather_rows(torch.tensor([int(os.environ.get("GROUP_RANK", 0))]))]
    per_node = {n: nodes.count(n) for n in nodes}
    hierarchical = len(per_node) > 1 and min(per_node.values()) > 1
    assert (state.topology is not None) == hierarchical
    if hierarchical:
        assert [nodes[r] for host in state.topology.hosts for r in host] == sorted(nodes)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    kinds = state.stats.plans
    assert kinds and all(k.startswith(plans.HIERARCHICAL) == hierarchical for k in kinds), kinds
    assert (state.stats.bytes_local > 0) == hierarchical
    weights = gather_rows(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert all(np.array_equal(weights[0], w) for w in weights)
