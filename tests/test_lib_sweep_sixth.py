"""A sixth round of pure-Python libraries' models against the per-example loop, through
``bench.lib_sweep``: x-transformers' newer norms and residuals (dynamic tanh, U-Net skips,
layers integrated by learned weights, the input reinjected, data-dependent ALiBi, adaptive
LayerNorm from a condition per example, the AutoregressiveWrapper's own loss), vit-pytorch's
CrossViT, ViT for small datasets and CCT, a BiLSTM-CRF tagger (pytorch-crf), PPO's loss of a
Stable-Baselines3 policy, MMDiT, Taylor-series linear attention, a point transformer,
EnCodec's SEANet autoencoder, and Segment Anything fine-tuned on boxes, its prompt encoder and
mask decoder run image by image; and those refused, each by gradhooks' own error (XCiT's
BatchNorm, MMDiT's hyper-connections called with the branch outside). Also, in plain torch, a
parameter used outside its module's call through ``torch.broadcast_tensors``
(``torch.distributions.Normal``), which gradhooks once refused. A model whose library is not
installed is skipped."""

from __future__ import annotations

import pytest
import torch
from test_lib_sweep import (  # noqa: F401 (_quiet: a fixture, used by name)
    _needs,
    _quiet,
    assert_setting_match,
    assert_swept_match,
    assert_swept_refused,
    lib_sweep,
)
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad

# The quicker ones of each library: bench.lib_sweep runs them all (x-transformers' LASER,
# orthogonal, aggregated and gated residuals, CoPE, selective attention, polar positions; CaiT,
# DeepViT, T2T-ViT, Simple ViT with registers; a CNN policy; Taylor-series ViT; IPA; SegFormer).
MODELS = [
    "xt-dynamic-tanh",  # DyT in place of the norms
    "xt-unet-skips",  # U-Net skips between layers
    "xt-integrate-layers",  # every layer's output mixed by learned weights
    "xt-reinject-input",  # the input reinjected at each layer, gated
    "xt-data-dependent-alibi",  # ALiBi slopes computed from the tokens
    "xt-adaptive-layernorm",  # ada-LN-zero from a condition per example
    "xt-autoregressive-wrapper",  # the library's own next-token loss of the batch
    "cross-vit",  # two patch sizes, class tokens cross-attending
    "vit-small-dataset",  # shifted patch tokenization, learned temperature
    "cct",  # convolutional tokenizer, sequence pooling
    "crf-bilstm",  # the CRF's log-likelihood of padded sequences
    "sb3-ppo-gaussian",  # log_std outside any layer, through torch.distributions.Normal
    "mmdit",  # joint text-image attention, adaptive norms from the timestep
    "taylor-linear-attention",  # second-order Taylor feature maps, rotary
    "point-transformer",  # vector attention over each point's nearest neighbours
    "encodec-seanet",  # torch.nn.utils.weight_norm: the weight recomputed by a pre-hook
    "sam",  # each image's box corners' embeddings added in place into its prompt's rows
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        ("xcit", gradhooks.MixedExamplesError),  # BatchNorm2d in its local patch interaction
        ("mmdit-hyper", gradhooks.UnsupportedError),  # a residual function returned by the call
    ],
)
def test_library_model_refused(name, error):
    """Refused by gradhooks' own error, naming the layer, never a grad1 given."""
    assert_swept_refused(name, error)


@pytest.mark.parametrize(
    "name, setting",
    [
        ("sb3-ppo-gaussian", "dp-step"),  # log_std outside any layer, clipped with the rest
        ("crf-bilstm", "training"),  # the CRF's transitions over 3 SGD steps
        ("sam", "dp-step"),  # the corners' embeddings clipped with the rest
    ],
)
def test_library_model_in_another_setting(name, setting):
    """A DP step (p.grad against the loop's clipped sum), 3 SGD steps (grad1 of each against
    the loop)."""
    assert_setting_match(name, setting)


class GaussianPolicy(nn.Module):
    """Stable-Baselines3's ``ActorCriticPolicy`` for a continuous action, shrunk: the mean by a
    Linear, a state-independent ``log_std`` (``std = ones_like(mean) * log_std.exp()``), and
    ``evaluate_actions``, a method, called by the loss's module as SB3's ``PPO.train`` does."""

    def __init__(self, broadcast: str):
        super().__init__()
        self.action_net = nn.Linear(4, 2)
        self.log_std = nn.Parameter(torch.linspace(-0.5, 0.5, 2))
        self.broadcast = broadcast

    def evaluate_actions(self, obs, actions):
        mean = self.action_net(obs)
        std = torch.ones_like(mean) * self.log_std.exp()
        if self.broadcast == "distribution":
            dist = torch.distributions.Normal(mean, std)  # (broadcast_all: broadcast_tensors)
            return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
        mean, std, actions = torch.broadcast_tensors(mean, std, actions)
        return (-((actions - mean) ** 2) / (2 * std**2) - std.log()).sum(-1), std.log().sum(-1)


class PolicyLoss(nn.Module):
    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs, actions):
        log_prob, entropy = self.policy.evaluate_actions(obs, actions)
        return -log_prob - 0.01 * entropy


@pytest.mark.parametrize("broadcast", ["distribution", "broadcast_tensors"])
def test_parameter_broadcast_with_the_batch_outside_its_call_matches_the_loop(broadcast):
    """``torch.broadcast_tensors`` (which ``torch.distributions`` calls on its arguments)
    expands each tensor alone: ``log_std``'s expansion meets the batch later, in the
    log-probability, each example's share of its gradient its own. (gradhooks once refused
    it, the batch lost through broadcast_tensors.)"""
    torch.manual_seed(0)
    model = PolicyLoss(GaussianPolicy(broadcast)).double()
    obs = torch.randn(3, 4, dtype=torch.float64)
    actions = torch.randn(3, 2, dtype=torch.float64)
    want = loop_grad(model, lambda losses: losses.sum(), (obs, actions))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(obs, actions).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-12, msg=name)


def test_parameter_broadcast_into_a_mix_of_examples_is_refused():
    """The expansion of ``log_std`` meets a tensor that mixes the examples (the batch's mean
    subtracted): no example's share exists, and the backward is refused."""

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = GaussianPolicy("broadcast_tensors")

        def forward(self, obs):
            mean = self.policy.action_net(obs)
            centred = mean - mean.mean(0)
            std, centred = torch.broadcast_tensors(self.policy.log_std.exp(), centred)
            return (centred / std).pow(2).sum(-1)

    model = Centred().double()
    with pytest.raises(gradhooks.MixedExamplesError):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    assert not hasattr(model.policy.log_std, "grad1")


def test_sweep_turns_stochastic_depth_off():
    """CCT's DropPath (timm's, copied) draws a keep mask per example in training mode: with
    ``drop_prob=0.1`` two forwards often come out equal, passing the sweep's check for random
    numbers, and a loop that drew other masks then read as a mismatch. The sweep sets its
    ``drop_prob`` to 0, as it sets every dropout's ``p``."""
    _needs("cct")
    built = lib_sweep.CASES["cct"].build().model
    assert max(m.drop_prob for m in built.modules() if hasattr(m, "drop_prob")) > 0
    rates = [m.drop_prob for m in lib_sweep.prepare(built).modules() if hasattr(m, "drop_prob")]
    assert rates and all(r == 0.0 for r in rates)
