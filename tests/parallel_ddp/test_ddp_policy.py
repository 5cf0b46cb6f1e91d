"""The layer policy in the DDP door: exempt parameters (small, 1-D, or named by a rule) are
averaged exactly, the others go through their codec's exchange, bit for bit as mean_estimate
on the concatenation of their gradients; a passed-in policy is honoured or refused."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.policy import LayerPolicy, describe
from horovod_quant.torch import ddp

from conftest import codec_params, gather_rows
from test_ddp_exact import Recorder, _batch, _model


class Wide(torch.nn.Module):
    """A 128-element bias (the policy leaves it exact) between two weight matrices."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(128, 16)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def _hidden_bias_grad(policy):
    """(the DDP model's hidden-layer bias gradient, the exact mean of the ranks' local ones)
    after one step with 2-bit QSGD under ``policy``."""
    torch.manual_seed(0)
    local = Wide()
    model = DDP(Wide())
    model.module.load_state_dict(local.state_dict())
    model.register_comm_hook(ddp.QuantizationState(hq.get_codec("qsgd", bits=2), seed=1,
                                                   policy=policy), ddp.quantization_hook)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(32, 64, generator=gen)
    model(x).square().mean().backward()
    local(x).square().mean().backward()
    rows = gather_rows(local.hidden.bias.grad)
    return model.module.hidden.bias.grad, sum(rows) / len(rows)


def test_exempt_bias_is_the_exact_mean():
    got, want = _hidden_bias_grad(None)  # the default policy: 1-D tensors travel exactly
    if dist.get_world_size() <= 2:
        assert torch.equal(got, want)
    else:  # gloo adds in its own order
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    got, want = _hidden_bias_grad(LayerPolicy.everything())  # the same bias through the codec
    if dist.get_world_size() > 1:
        assert (got - want).norm() > 0.1 * want.norm()


@pytest.mark.parametrize("rule_codec", ["natural", "global_qsgd"])
def test_name_rules_pick_a_codec_per_parameter(rule_codec):
    """Rules send ``b`` through another codec (Global-QSGD: an exchange whose exponent
    reduction pairs by call order) and ``branch`` exactly; buckets mix the three, each codec's
    part is mean_estimate's with its own seed, the exact part the exact mean."""
    other = hq.get_codec(rule_codec, **codec_params(rule_codec))
    model = _model(bucket_cap_mb=0.5)
    named = list(model.named_parameters())
    policy = LayerPolicy(rules=[(r"\.b\.", other), (r"branch", None)])
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=4), seed=9, policy=policy,
                                  fallback="never",
                                  named_parameters=named)
    assert [c.name for c in state.codecs] == ["qsgd", rule_codec]
    rec = Recorder(state, named_parameters=named)
    model.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mixed = 0
    for step in range(3):
        opt.zero_grad()
        model(_batch(step)).square().mean().backward()
        mixed += sum(len(rec.parts(params)) == 3 for _, _, params, _, _ in rec.calls)
        rec.check()
        opt.step()
    assert mixed > 0  # some bucket held exact, qsgd and rule-codec parameters at once


def test_compressor_policy_is_honoured():
    policy = LayerPolicy(min_elements=0, compress_1d=True)
    state = ddp.QuantizationState(hqt.Compression.qsgd(bits=4, policy=policy))
    assert state.policy is policy
    assert state.shared_config()["policy"] == describe(policy)
    model = _model()
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    model(_batch(0)).sum().backward()
    assert all(list(rec.parts(params)) == [0] for _, _, params, _, _ in rec.calls)
    rec.check()
    explicit = LayerPolicy(min_elements=10)  # policy= wins over the compressor's
    assert ddp.QuantizationState(hqt.Compression.qsgd(policy=policy),
                                 policy=explicit).policy is explicit


def test_name_rules_without_names_are_refused():
    rules = LayerPolicy(rules=[("bias", None)])
    with pytest.raises(ValueError, match="named_parameters=model.named_parameters"):
        ddp.QuantizationState(hq.get_codec("qsgd"), policy=rules)
    with pytest.raises(ValueError, match="named_parameters=model.named_parameters"):
        ddp.QuantizationState(hqt.Compression.qsgd(policy=rules))
    with pytest.raises(ValueError, match="not a horovod_quant LayerPolicy"):
        ddp.QuantizationState(hq.get_codec("qsgd"), policy={"min_elements": 0})
    with pytest.raises(ValueError, match="duplicates"):
        ddp.QuantizationState(hq.get_codec("qsgd"), named_parameters=[
            ("w", torch.nn.Parameter(torch.ones(2))), ("w", torch.nn.Parameter(torch.ones(2)))])

