"""Published training scripts, rewritten small, each step checked against the float64 oracle.

Each test follows one script of a public repository (cited in its docstring: repository and
path): its model and its training loop as written there, at tiny sizes, on synthetic data, in
float64. At every step ``grad1`` (or the DP-SGD step, where private training is the point) is
compared with each example's own gradient at that step's parameters, by a per-example loop
(:func:`gradhooks.oracle.loop_grad`, or a loop written out where the script's loss is not a
plain mean over examples); where no per-example gradient exists (a graph whose nodes are the
examples, batch norm in training mode), or the script cannot be hooked as written, the test
checks that gradhooks refuses with an error naming the module and leaves the model as it was.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import deque
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    one_thread,  # noqa: F401 (autouse in this module)
)

D = torch.float64


def per_example(model, hooks, batch: int, loss_of) -> dict[str, torch.Tensor]:
    """``{name: [batch, *shape]}``: the gradient of ``loss_of(i)`` (example ``i``'s own loss,
    computed from a batch of one) for every trainable parameter, with capture paused."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    with hooks.paused():
        for i in range(batch):
            grads = torch.autograd.grad(loss_of(i), [p for _, p in named], allow_unused=True)
            rows.append(
                [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)]
            )
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def assert_untouched(model, what: str) -> None:
    """No parameter holds a ``grad1`` after a refusal."""
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), f"{what}: {n} kept a grad1"


def clipped_mean(per_ex: dict, max_norm: float, divisor: float) -> dict:
    """``Σᵢ min(1, C/‖gᵢ‖) gᵢ / divisor`` (whole-model norms): a noiseless DP-SGD step's
    ``.grad``."""
    norms = torch.cat([g.flatten(1) for g in per_ex.values()], 1).norm(dim=1)
    factors = (max_norm / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factors, g) / divisor for n, g in per_ex.items()}


# -- pytorch/examples vae/main.py ------------------------------------------------------------------


class VAE(nn.Module):
    """pytorch/examples ``vae/main.py``'s VAE, 784-400-20 shrunk to 16-8-3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(16, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.fc3, self.fc4 = nn.Linear(3, 8), nn.Linear(8, 16)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 16))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def vae_loss(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 16), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def test_vae_example_reparameterized_with_the_kl_term_summed_over_the_batch(monkeypatch):
    """pytorch/examples ``vae/main.py``: ``torch.randn_like`` noise drawn inside the forward,
    a loss summed over the batch (binary cross-entropy plus the KL term), Adam, and a test pass
    and ``model.decode`` of a sample under ``no_grad`` between epochs. ``grad1[i]`` is example
    ``i``'s own loss's gradient with its own noise (the loop replays row ``i`` of the noise the
    batch drew), under ``loss_reduction="sum"``."""
    torch.manual_seed(0)
    model = VAE().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    real_randn_like = torch.randn_like
    drawn: list[torch.Tensor] = []
    replay: list[torch.Tensor] = []

    def randn_like(t, *args, **kwargs):  # records the batch's noise, replays one row of it
        if replay:
            return replay.pop()
        drawn.append(real_randn_like(t, *args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(torch, "randn_like", randn_like)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for epoch in range(2):
            model.train()
            for step in range(2):
                data = torch.rand(5, 1, 4, 4, generator=g, dtype=D)
                drawn.clear()
                opt.zero_grad()
                recon, mu, logvar = model(data)
                loss = vae_loss(recon, data, mu, logvar)
                loss.backward()
                (eps,) = drawn

                def own(i, data=data, eps=eps):
                    replay.append(eps[i : i + 1])
                    recon, mu, logvar = model(data[i : i + 1])
                    return vae_loss(recon, data[i : i + 1], mu, logvar)

                assert_grad1(model, per_example(model, h, 5, own), f"epoch {epoch} step {step}")
                opt.step()
            model.eval()
            with torch.no_grad():
                data = torch.rand(7, 1, 4, 4, generator=g, dtype=D)
                recon, mu, logvar = model(data)
                vae_loss(recon, data, mu, logvar).item()
                model.decode(torch.randn(4, 3, generator=g, dtype=D))
            assert model.fc1.weight.grad1.shape[0] == 5  # nothing captured under no_grad


# -- pytorch/examples siamese_network/main.py ------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` (what ``resnet18`` stacks), with its BatchNorms."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class SiameseNetwork(nn.Module):
    """pytorch/examples ``siamese_network/main.py``: a ResNet without its ``fc`` (here a stem
    and two basic blocks, 1-channel input) run on each image, the two feature vectors
    concatenated, an MLP head and a sigmoid."""

    def __init__(self) -> None:
        super().__init__()
        self.resnet = nn.Sequential(
            nn.Conv2d(1, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            BasicBlock(4, 4, 1), BasicBlock(4, 6, 2), nn.AdaptiveAvgPool2d((1, 1)),
        )  # fmt: skip
        self.fc = nn.Sequential(nn.Linear(12, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
        self.sigmoid = nn.Sigmoid()
        for m in self.fc:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                m.bias.data.fill_(0.01)

    def forward_once(self, x):
        output = self.resnet(x)
        return output.view(output.size()[0], -1)

    def forward(self, input1, input2):
        output = torch.cat((self.forward_once(input1), self.forward_once(input2)), 1)
        return self.sigmoid(self.fc(output))


def test_siamese_network_with_batch_norm_is_refused_naming_it_and_trains_once_converted():
    """pytorch/examples ``siamese_network/main.py``: the ResNet's BatchNorm in training mode
    normalizes each image with the batch's statistics: refused, naming the layer, no grad1
    left. After :func:`gradhooks.convert_batch_norm`, the script's loop (two calls of the
    tower per step, ``BCELoss`` on ``outputs.squeeze()``, Adadelta, StepLR) has each pair's own
    gradient in grad1, and the test pass in eval mode captures nothing."""
    torch.manual_seed(0)
    model = SiameseNetwork().to(D)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.rand(4, 1, 8, 8, generator=g, dtype=D) for _ in range(2))
    targets = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"resnet\.1.*BatchNorm2d"):
            nn.BCELoss()(model(a, b).squeeze(), targets).backward()
    assert_untouched(model, "refused")
    model = gradhooks.convert_batch_norm(model)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    criterion = nn.BCELoss()
    with gradhooks.add_hooks(model) as h:
        for epoch in range(2):
            model.train()
            for step in range(2):
                a, b = (torch.rand(4, 1, 8, 8, generator=g, dtype=D) for _ in range(2))
                opt.zero_grad()
                criterion(model(a, b).squeeze(), targets).backward()
                want = per_example(
                    model, h, 4,
                    lambda i, a=a, b=b: criterion(model(a[i : i + 1], b[i : i + 1]).view(1),
                                                  targets[i : i + 1]),
                )  # fmt: skip
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                opt.step()
            model.eval()
            with torch.no_grad():
                criterion(model(a[:3], b[:3]).squeeze(), targets[:3]).item()
            assert model.fc[0].weight.grad1.shape[0] == 4
            sched.step()


# -- pytorch/examples reinforcement_learning/reinforce.py and actor_critic.py ----------------------


class Policy(nn.Module):
    """pytorch/examples ``reinforcement_learning/reinforce.py``'s policy (128 hidden units
    shrunk to 8), its dropout included."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 8)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(8, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


def _episode(policy, states, gamma: float = 0.99):
    """``select_action`` at every state (a batch of one, ``state.unsqueeze(0)``), rewards of
    1, then ``finish_episode``'s loss: the returns, normalized over the episode, weighting
    ``-log_prob`` of each action taken, ``torch.cat(...).sum()``."""
    saved_log_probs, rewards = [], []
    for state in states:
        m = torch.distributions.Categorical(policy(state.unsqueeze(0)))
        action = m.sample()
        saved_log_probs.append(m.log_prob(action))
        rewards.append(1.0)
    R, returns = 0.0, deque()
    for r in rewards[::-1]:
        R = r + gamma * R
        returns.appendleft(R)
    returns = torch.tensor(returns, dtype=D)
    returns = (returns - returns.mean()) / (returns.std() + torch.finfo(torch.float32).eps)
    return torch.cat([-log_prob * R for log_prob, R in zip(saved_log_probs, returns)]).sum()


def test_reinforce_episode_of_single_state_calls_is_one_example():
    """pytorch/examples ``reinforcement_learning/reinforce.py``: the policy is called once per
    time step on a batch of one, the episode's loss sums the steps, one backward per episode,
    Adam. Every call has one row, so grad1 has one: the episode's gradient, equal to that of
    an unhooked twin replaying the same dropout masks and action samples."""
    torch.manual_seed(0)
    policy = Policy().to(D)
    twin = copy.deepcopy(policy)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (policy, twin)]
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(policy, loss_reduction="sum"):
        for episode in range(3):
            states = torch.randn(4 + episode, 4, generator=g, dtype=D)
            for m, o in ((policy, opts[0]), (twin, opts[1])):
                torch.manual_seed(100 + episode)
                o.zero_grad()
                _episode(m, states).backward()
            want = {n: q.grad.unsqueeze(0) for n, q in twin.named_parameters()}
            assert_grad1(policy, want, f"episode {episode}")
            for o in opts:
                o.step()


class ActorCritic(nn.Module):
    """pytorch/examples ``reinforcement_learning/actor_critic.py``'s model: one trunk, an
    action head and a value head."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 8)
        self.action_head, self.value_head = nn.Linear(8, 2), nn.Linear(8, 1)

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


def test_actor_critic_on_states_without_a_batch_dimension_is_refused_naming_the_layer():
    """pytorch/examples ``reinforcement_learning/actor_critic.py`` calls the model on each
    state as it comes, ``[4]``, without a batch dimension: there are no examples to tell
    apart, and the backward is refused naming a head and the shape, leaving no grad1."""
    torch.manual_seed(0)
    model = ActorCritic().to(D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        policy_losses, value_losses = [], []
        for _ in range(3):
            probs, value = model(torch.randn(4, dtype=D))
            m = torch.distributions.Categorical(probs)
            action = m.sample()
            policy_losses.append(-m.log_prob(action) * (0.5 - value.item()))
            value_losses.append(F.smooth_l1_loss(value, torch.tensor([0.5], dtype=D)))
        loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
        with pytest.raises(gradhooks.UnbatchedInputError, match=r"'(action|value)_head'.*\(8,\)"):
            loss.backward()
    assert_untouched(model, "refused")


# -- pytorch/examples super_resolution -------------------------------------------------------------


class SuperResolutionNet(nn.Module):
    """pytorch/examples ``super_resolution/model.py``: four convolutions, the last to
    ``upscale_factor ** 2`` channels, then ``nn.PixelShuffle``; orthogonal initialization."""

    def __init__(self, upscale_factor: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 6, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(6, 6, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(6, 4, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(4, upscale_factor**2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        for c, gain in ((self.conv1, 2**0.5), (self.conv2, 2**0.5), (self.conv3, 2**0.5)):
            nn.init.orthogonal_(c.weight, gain)
        nn.init.orthogonal_(self.conv4.weight)

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))


def test_super_resolution_with_pixel_shuffle_and_a_psnr_test_pass():
    """pytorch/examples ``super_resolution/main.py``: ``MSELoss`` between the upscaled
    output and the target, Adam, then the PSNR of a test batch under ``no_grad``."""
    torch.manual_seed(0)
    model = SuperResolutionNet(upscale_factor=3).to(D)
    criterion = nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x = torch.rand(3, 1, 5, 5, generator=g, dtype=D)
            target = torch.rand(3, 1, 15, 15, generator=g, dtype=D)
            want = loop_grad(model, criterion, x, target)
            opt.zero_grad()
            criterion(model(x), target).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            with torch.no_grad():
                mse = criterion(model(x[:2]), target[:2])
                assert math.isfinite(10 * math.log10(1 / mse.item()))


# -- pytorch/examples mnist_rnn/main.py ------------------------------------------------------------


class MnistRNN(nn.Module):
    """pytorch/examples ``mnist_rnn/main.py``: an LSTM over the image's rows (batch first),
    its last output, BatchNorm1d, Dropout2d, two Linear layers, log_softmax (28x28 images and
    64 hidden units shrunk to 6x6 and 8)."""

    def __init__(self, p1: float = 0.25, p2: float = 0.5) -> None:
        super().__init__()
        self.rnn = nn.LSTM(input_size=6, hidden_size=8, batch_first=True)
        self.batchnorm = nn.BatchNorm1d(8)
        self.dropout1, self.dropout2 = nn.Dropout2d(p1), nn.Dropout2d(p2)
        self.fc1, self.fc2 = nn.Linear(8, 5), nn.Linear(5, 10)

    def forward(self, input):
        output, hidden = self.rnn(input.reshape(-1, 6, 6))
        output = self.batchnorm(output[:, -1, :])
        output = F.relu(self.fc1(self.dropout1(output)))
        return F.log_softmax(self.fc2(self.dropout2(output)), dim=1)


def test_mnist_rnn_batch_norm_in_training_is_refused_and_its_running_statistics_are_not():
    """pytorch/examples ``mnist_rnn/main.py``: in training mode the BatchNorm1d after the
    LSTM mixes the batch: refused naming ``batchnorm``, no grad1 left. With the norm in eval
    mode (its running statistics: fine-tuning with the statistics frozen) and the dropouts
    off, the loop (``nll_loss``, Adadelta, StepLR) gives each image's own gradient, the
    LSTM's included."""
    torch.manual_seed(0)
    model = MnistRNN().to(D)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 6, 6, generator=g, dtype=D), torch.randint(10, (4,), generator=g)
    with gradhooks.add_hooks(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Dropout2d on [batch, features] warns)
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'batchnorm' \(BatchNorm1d\)"):
            F.nll_loss(model(x), y).backward()
    assert_untouched(model, "refused")
    torch.manual_seed(0)
    model = MnistRNN(0.0, 0.0).to(D)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    with gradhooks.add_hooks(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(2):
            model.train()
            model.batchnorm.eval()
            x, y = (
                torch.randn(4, 1, 6, 6, generator=g, dtype=D),
                torch.randint(10, (4,), generator=g),
            )
            want = loop_grad(model, F.nll_loss, x, y)
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            assert_grad1(model, want, f"epoch {epoch}")
            opt.step()
            sched.step()


# -- pytorch/examples mnist_forward_forward/main.py ------------------------------------------------


class FFLayer(nn.Linear):
    """pytorch/examples ``mnist_forward_forward/main.py``'s ``Layer``: an ``nn.Linear`` whose
    ``forward`` normalizes each input row, with its own Adam and its own ``train(x_pos,
    x_neg)`` (shadowing ``nn.Module.train``). ``via_call``: the layer is called as
    ``self(x)`` where the script writes ``self.forward(x)``."""

    def __init__(self, in_features: int, out_features: int, via_call: bool) -> None:
        super().__init__(in_features, out_features, dtype=D)
        self.relu = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)
        self.threshold, self.num_epochs, self.via_call = 2.0, 2, via_call

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def goodness_loss(self, x_pos, x_neg):
        run = self if self.via_call else self.forward
        g_pos, g_neg = run(x_pos).pow(2).mean(1), run(x_neg).pow(2).mean(1)
        return torch.log1p(
            torch.exp(torch.cat([-g_pos + self.threshold, g_neg - self.threshold]))
        ).mean()

    def train(self, x_pos, x_neg, hooks=None):
        for i in range(self.num_epochs):
            loss = self.goodness_loss(x_pos, x_neg)
            self.opt.zero_grad()
            loss.backward()
            if hooks is not None:  # the pair (x_pos[i], x_neg[i]) is example i
                want = per_example(
                    self, hooks, x_pos.shape[0],
                    lambda k: self.goodness_loss(x_pos[k : k + 1], x_neg[k : k + 1]),
                )  # fmt: skip
                assert_grad1(self, want, f"epoch {i}")
            self.opt.step()
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


def _overlay_y_on_x(x, y):
    x_ = x.clone()
    x_[:, :10] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


def test_forward_forward_layer_local_losses_several_backwards_per_layer():
    """pytorch/examples ``mnist_forward_forward/main.py``: the layers live in a Python list
    (not submodules), each is trained alone on its own goodness loss over the positive and the
    negative batch concatenated, with its own optimizer, then feeds the next one detached. Each
    layer is hooked. Called as the script does, ``self.forward(x)``, no hook runs: a warning
    says so and no grad1 is written. Called as ``self(x)``, grad1[i] is the gradient of pair
    ``i``'s share of the loss (its positive and its negative term), at every backward."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 14, generator=g, dtype=D), torch.randint(10, (5,), generator=g)
    y_neg = (y + torch.randint(1, 10, (5,), generator=g)) % 10
    x_pos, x_neg = _overlay_y_on_x(x, y), _overlay_y_on_x(x, y_neg)

    torch.manual_seed(0)
    layer = FFLayer(14, 8, via_call=False)
    with gradhooks.add_hooks(layer), pytest.warns(gradhooks.GradhooksWarning, match="no forward"):
        layer.train(x_pos, x_neg)
    assert_untouched(layer, "called through forward")

    torch.manual_seed(0)
    layers = [FFLayer(14, 8, via_call=True), FFLayer(8, 8, via_call=True)]
    h_pos, h_neg = x_pos, x_neg
    for k, layer in enumerate(layers):
        with gradhooks.add_hooks(layer) as h:
            h_pos, h_neg = layer.train(h_pos, h_neg, hooks=h)
        assert layer.weight.grad1.shape == (5, 8, layer.in_features), f"layer {k}"


# -- pytorch/examples gcn/main.py ------------------------------------------------------------------


class GraphConv(nn.Module):
    """pytorch/examples ``gcn/main.py``'s ``GraphConv``: ``adj @ (x @ kernel) + bias`` by
    ``torch.mm`` and ``torch.spmm``."""

    def __init__(self, input_dim: int, output_dim: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(input_dim, output_dim, dtype=D))
        nn.init.xavier_normal_(self.kernel)
        self.bias = nn.Parameter(torch.zeros(output_dim, dtype=D))

    def forward(self, input_tensor, adj_mat):
        return torch.spmm(adj_mat, torch.mm(input_tensor, self.kernel)) + self.bias


class GCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gc1, self.gc2 = GraphConv(6, 5), GraphConv(5, 3)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_tensor, adj_mat):
        x = self.dropout(F.relu(self.gc1(input_tensor, adj_mat)))
        return F.log_softmax(self.gc2(x, adj_mat), dim=1)


def _cora_like(nodes: int = 7):
    """Sparse node features and the renormalized adjacency ``D^-1/2 (A + I) D^-1/2``, sparse,
    as ``load_cora`` builds them."""
    g = torch.Generator().manual_seed(0)
    a = (torch.rand(nodes, nodes, generator=g) < 0.3).to(D)
    a = ((a + a.T) > 0).to(D) + torch.eye(nodes, dtype=D)
    d = a.sum(1).rsqrt()
    features = (torch.rand(nodes, 6, generator=g) < 0.4).to(D)
    return (
        features.to_sparse(),
        (d[:, None] * a * d[None]).to_sparse(),
        torch.randint(3, (nodes,), generator=g),
    )


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("frozen", [None, "gc2"])
def test_gcn_the_nodes_are_not_examples_refused_naming_the_layer(sparse, frozen):
    """pytorch/examples ``gcn/main.py``: the batch dimension of the features is the graph's
    nodes, and ``spmm(adj, ...)`` makes each node's output depend on its neighbours': a node
    has no gradient of its own. The step (``nll_loss`` on the training mask) is refused with a
    ``MixedExamplesError`` naming the layer whose input mixes the nodes (the whole model when
    the layer that mixes them is the only one trained), whether the tensors are sparse or
    dense; no grad1 is left."""
    features, adj, labels = _cora_like()
    if not sparse:
        features, adj = features.to_dense(), adj.to_dense()
    torch.manual_seed(0)
    model = GCN()
    if frozen:
        model.gc2.requires_grad_(False)
    mask = torch.arange(7) < 5
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match="'gc2'" if not frozen else "GCN"):
            F.nll_loss(model(features, adj)[mask], labels[mask]).backward()
    assert_untouched(model, "refused")


# -- pytorch/examples language_translation ---------------------------------------------------------


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 32) -> None:
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pos_embedding.unsqueeze(-2))

    def forward(self, token_embedding):
        return self.dropout(token_embedding + self.pos_embedding[: token_embedding.size(0), :])


class Translator(nn.Module):
    """pytorch/examples ``language_translation/src/model.py``: two embeddings, a sinusoidal
    positional encoding, ``nn.Transformer`` (sequence first), a Linear to the target
    vocabulary; xavier-uniform initialization of every matrix."""

    def __init__(self, vocab: int = 11, embed_size: int = 8) -> None:
        super().__init__()
        self.src_embedding = nn.Embedding(vocab, embed_size)
        self.tgt_embedding = nn.Embedding(vocab, embed_size)
        self.pos_enc = PositionalEncoding(embed_size, 0.0)
        self.transformer = nn.Transformer(
            d_model=embed_size, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
            dim_feedforward=12, dropout=0.0,
        )  # fmt: skip
        self.ff = nn.Linear(embed_size, vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, mem_mask):
        src_emb = self.pos_enc(self.src_embedding(src))
        tgt_emb = self.pos_enc(self.tgt_embedding(trg))
        outs = self.transformer(
            src_emb, tgt_emb, src_mask, tgt_mask, None, src_padding_mask, tgt_padding_mask,
            mem_mask,
        )  # fmt: skip
        return self.ff(outs)


PAD = 1


def _create_mask(src, tgt):
    """``language_translation/src/data.py``'s ``create_mask``."""
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[0], dtype=D)
    src_mask = torch.zeros((src.shape[0], src.shape[0])).type(torch.bool)
    return src_mask, tgt_mask, (src == PAD).transpose(0, 1), (tgt == PAD).transpose(0, 1)


def _translate(model, src, tgt):
    tgt_input = tgt[:-1, :]
    src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = _create_mask(src, tgt_input)
    logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask,
                   src_padding_mask)  # fmt: skip
    return logits, tgt[1:, :]


@pytest.mark.parametrize("batch,src_len,tgt_len", [(3, 5, 6), (5, 5, 6)], ids=["B3", "B=S=T-1"])
def test_language_translation_transformer_sequence_first_with_masks_and_ignore_index(
    batch, src_len, tgt_len
):
    """pytorch/examples ``language_translation/main.py``'s ``train``: ``[seq, batch]`` token
    batches (``batch_dim=1``), the causal target mask, boolean padding masks ``[batch, seq]``
    built outside the model, ``CrossEntropyLoss(ignore_index=PAD)`` over the flattened tokens
    (a mean over the batch's non-pad tokens: example ``i``'s share is its tokens' summed loss
    over that count, times the batch size under ``loss_reduction="mean"``), Adam with the
    script's betas and eps. Also with batch, source length and target length equal, where
    the square masks are as long as the batch."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: nested tensors need batch_first)
        model = Translator().to(D)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, batch_dim=1) as h, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: a bool padding mask beside a float attn mask)
        for step in range(2):
            src = torch.randint(2, 11, (src_len, batch), generator=g)
            tgt = torch.randint(2, 11, (tgt_len, batch), generator=g)
            src[src_len - 1 - step :, 0] = PAD
            tgt[tgt_len - 2 :, 1] = PAD
            logits, tgt_out = _translate(model, src, tgt)
            opt.zero_grad()
            loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1)).backward()
            tokens = (tgt_out != PAD).sum()

            def own(i, src=src, tgt=tgt, tokens=tokens):
                lg, out = _translate(model, src[:, i : i + 1], tgt[:, i : i + 1])
                total = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), out.reshape(-1),
                                        ignore_index=PAD, reduction="sum")  # fmt: skip
                return total * batch / tokens

            assert_grad1(model, per_example(model, h, batch, own), f"step {step}")
            opt.step()


# -- pytorch/examples time_sequence_prediction/train.py --------------------------------------------


class Sequence(nn.Module):
    """pytorch/examples ``time_sequence_prediction/train.py``: two stacked ``LSTMCell``s
    stepped over ``input.split(1, dim=1)``, zero initial states of the batch's size, then
    ``future`` steps fed back their own output (51 hidden units shrunk to 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm1, self.lstm2 = nn.LSTMCell(1, 5), nn.LSTMCell(5, 5)
        self.linear = nn.Linear(5, 1)

    def forward(self, input, future: int = 0):
        outputs = []
        h_t, c_t, h_t2, c_t2 = (torch.zeros(input.size(0), 5, dtype=D) for _ in range(4))
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def test_time_sequence_prediction_lstm_cells_under_lbfgs():
    """pytorch/examples ``time_sequence_prediction/train.py``: sine waves, ``MSELoss`` of the
    next value, LBFGS whose closure runs the forward and backward several times per step;
    every closure's grad1 is each wave's own gradient at the parameters it ran at; then the
    ``no_grad`` prediction of ``future`` steps captures nothing."""
    torch.manual_seed(0)
    seq = Sequence().double()
    t = torch.arange(9, dtype=D)
    data = torch.sin(t[None] / 2.0 + torch.tensor([[0.0], [0.7], [1.9], [2.6], [4.0]], dtype=D))
    input, target = data[1:, :-1], data[1:, 1:]
    test_input = data[:1, :-1]
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=3)
    closures = []
    with gradhooks.add_hooks(seq):
        for i in range(2):

            def closure():
                want = loop_grad(seq, criterion, input, target)
                optimizer.zero_grad()
                loss = criterion(seq(input), target)
                loss.backward()
                assert_grad1(seq, want, f"step {i}, closure {len(closures)}")  # noqa: B023
                closures.append(loss.item())
                return loss

            optimizer.step(closure)
            with torch.no_grad():
                pred = seq(test_input, future=4)
                assert pred.shape == (1, 12)
            assert seq.linear.weight.grad1.shape[0] == 4
    assert len(closures) > 2


# -- karpathy/makemore makemore.py -----------------------------------------------------------------

MAKEMORE = SimpleNamespace(vocab_size=7, block_size=6, n_embd=4, n_embd2=5)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class MakemoreBigram(nn.Module):
    """makemore's ``Bigram``: a table of next-character logits, a parameter of the model
    itself, indexed by the input; the loss computed in the forward when targets are given."""

    def __init__(self, config) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros((config.vocab_size, config.vocab_size)))

    def forward(self, idx, targets=None):
        logits = self.logits[idx]
        return logits, None if targets is None else _lm_loss(logits, targets)


class MakemoreMLP(nn.Module):
    """makemore's ``MLP`` (Bengio et al. 2003): the previous ``block_size`` tokens' embeddings
    by ``torch.roll`` along the sequence with a blank token written in place, concatenated."""

    def __init__(self, config) -> None:
        super().__init__()
        self.block_size, self.vocab_size = config.block_size, config.vocab_size
        self.wte = nn.Embedding(config.vocab_size + 1, config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(self.block_size * config.n_embd, config.n_embd2), nn.Tanh(),
            nn.Linear(config.n_embd2, self.vocab_size),
        )  # fmt: skip

    def forward(self, idx, targets=None):
        embs = []
        for _ in range(self.block_size):
            embs.append(self.wte(idx))
            idx = torch.roll(idx, 1, 1)
            idx[:, 0] = self.vocab_size
        logits = self.mlp(torch.cat(embs, -1))
        return logits, None if targets is None else _lm_loss(logits, targets)


class CausalBoW(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, config.block_size, config.block_size
            ),
        )

    def forward(self, x):
        B, T, C = x.size()
        att = torch.zeros((B, T, T), device=x.device)
        att = att.masked_fill(self.bias[:, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ x


class BoWBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.cbow = CausalBoW(config)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(config.n_embd, config.n_embd2),
            c_proj=nn.Linear(config.n_embd2, config.n_embd),
        ))  # fmt: skip
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(F.tanh(m.c_fc(x)))

    def forward(self, x):
        x = x + self.cbow(x)
        return x + self.mlpf(x)


class MakemoreBoW(nn.Module):
    """makemore's ``BoW``: token and position embeddings, a causal bag of words (a uniform
    causal attention built from ``torch.zeros((B, T, T))``), an MLP through a lambda."""

    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.context_block = BoWBlock(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.context_block(self.wte(idx) + self.wpe(pos))
        logits = self.lm_head(x)
        return logits, None if targets is None else _lm_loss(logits, targets)


class MakemoreRNNCell(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.xh_to_h = nn.Linear(config.n_embd + config.n_embd2, config.n_embd2)

    def forward(self, xt, hprev):
        return F.tanh(self.xh_to_h(torch.cat([xt, hprev], dim=1)))


class MakemoreGRUCell(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        n = config.n_embd + config.n_embd2
        self.xh_to_z, self.xh_to_r = nn.Linear(n, config.n_embd2), nn.Linear(n, config.n_embd2)
        self.xh_to_hbar = nn.Linear(n, config.n_embd2)

    def forward(self, xt, hprev):
        xh = torch.cat([xt, hprev], dim=1)
        r = F.sigmoid(self.xh_to_r(xh))
        hbar = F.tanh(self.xh_to_hbar(torch.cat([xt, r * hprev], dim=1)))
        z = F.sigmoid(self.xh_to_z(xh))
        return (1 - z) * hprev + z * hbar


class MakemoreRNN(nn.Module):
    """makemore's ``RNN``: a learned start state, a parameter of the model itself expanded
    to the batch (``self.start.expand((b, -1))``), a cell (its own RNN or GRU, built of
    Linear layers) stepped over the sequence, the hidden states stacked."""

    def __init__(self, config, cell_type: str) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.zeros(1, config.n_embd2))
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.cell = (MakemoreRNNCell if cell_type == "rnn" else MakemoreGRUCell)(config)
        self.lm_head = nn.Linear(config.n_embd2, config.vocab_size)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        emb = self.wte(idx)
        hprev = self.start.expand((b, -1))
        hiddens = []
        for i in range(t):
            hprev = self.cell(emb[:, i, :], hprev)
            hiddens.append(hprev)
        logits = self.lm_head(torch.stack(hiddens, 1))
        return logits, None if targets is None else _lm_loss(logits, targets)


def _names(batch: int, g, config=MAKEMORE):
    """``CharDataset.__getitem__``'s pairs: ``x`` a 0 then the word's characters, ``y`` the
    characters, a 0, then -1 (masked out of the loss) to the block's end."""
    X = torch.zeros(batch, config.block_size, dtype=torch.long)
    Y = torch.zeros_like(X)
    for i in range(batch):
        n = int(torch.randint(1, config.block_size - 1, (1,), generator=g))
        ix = torch.randint(1, config.vocab_size, (n,), generator=g)
        X[i, 1 : 1 + n], Y[i, :n], Y[i, n + 1 :] = ix, ix, -1
    return X, Y


@pytest.fixture
def float64_default():
    """The default dtype float64 (makemore's ``torch.zeros`` in the forward follows it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(D)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


MAKEMORE_MODELS = {
    "mlp": lambda: MakemoreMLP(MAKEMORE),
    "bow": lambda: MakemoreBoW(MAKEMORE),
    "rnn": lambda: MakemoreRNN(MAKEMORE, "rnn"),
    "gru": lambda: MakemoreRNN(MAKEMORE, "gru"),
}


@pytest.mark.parametrize("kind", list(MAKEMORE_MODELS))
def test_makemore_models_loss_inside_with_ignore_index(kind, float64_default):
    """karpathy/makemore ``makemore.py``'s training loop: ``logits, loss = model(X, Y)`` (the
    loss computed in the forward, ``ignore_index=-1`` masking each name's padding, so a mean
    over the batch's unmasked characters), ``model.zero_grad(set_to_none=True)``, backward,
    AdamW with the script's betas. Example ``i``'s share: its characters' summed loss over
    the batch's count, times the batch size."""
    torch.manual_seed(0)
    model = MAKEMORE_MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.01, betas=(0.9, 0.99),
                            eps=1e-8)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            X, Y = _names(4, g)
            logits, loss = model(X, Y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            count = (Y != -1).sum()

            def own(i, X=X, Y=Y, count=count):
                lg, _ = model(X[i : i + 1])
                per_char = F.cross_entropy(lg.view(-1, lg.size(-1)), Y[i], ignore_index=-1,
                                           reduction="sum")  # fmt: skip
                return per_char * 4 / count

            assert_grad1(model, per_example(model, h, 4, own), f"{kind} step {step}")
            opt.step()


def test_makemore_bigram_table_indexed_by_the_input(float64_default):
    """makemore's ``Bigram``: its table is a parameter of the model itself, so the whole
    model is recomputed per example (the fallback). With the logits returned and the loss
    taken outside, each name's own gradient. With the loss computed in the forward, as the
    script's training loop does, the fallback cannot split a batch's loss into examples:
    refused, naming the model and saying to take the loss outside, no grad1 left."""
    torch.manual_seed(0)
    model = MakemoreBigram(MAKEMORE)
    g = torch.Generator().manual_seed(0)
    X, Y = _names(4, g)
    with gradhooks.add_hooks(model):
        _, loss = model(X, Y)
        with pytest.raises(gradhooks.UnsupportedInputError, match=r"Bigram.*outside"):
            loss.backward()
    assert_untouched(model, "refused")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.01)
    with gradhooks.add_hooks(model) as h:
        for step in range(2):
            X, Y = _names(4, g)
            logits, _ = model(X)
            model.zero_grad(set_to_none=True)
            _lm_loss(logits, Y).backward()
            count = (Y != -1).sum()

            def own(i, X=X, Y=Y, count=count):
                lg, _ = model(X[i : i + 1])
                return F.cross_entropy(lg[0], Y[i], ignore_index=-1, reduction="sum") * 4 / count

            assert_grad1(model, per_example(model, h, 4, own), f"step {step}")
            opt.step()


# -- Opacus' examples, with make_private in place of Opacus' PrivacyEngine -------------------------


def _sgd_step_is_the_clipped_mean(model, before, want, lr, what: str) -> None:
    """After an SGD step (no momentum) on a noiseless DP-SGD gradient, every parameter moved
    by ``-lr`` times the clipped mean ``want``."""
    for n, p in model.named_parameters():
        assert_close(p.detach(), before[n] - lr * want[n], f"{what}: {n}")


def _run_private(model, private, loss_of, lr, expected_batch_size, max_norm):
    """The script's loop over ``private.batches()``: each batch's per-example losses to
    ``private.backward``, ``private.step()``; each step checked against the clipped mean of
    the batch's own per-example gradients by the loop, at the step's parameters."""
    steps = 0
    for batch in private.batches():
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        size = batch[0].shape[0]
        with gradhooks.paused():
            rows = [
                torch.autograd.grad(
                    loss_of(model, *(t[i : i + 1] for t in batch)).sum(), list(model.parameters())
                )
                for i in range(size)
            ]
        names = [n for n, _ in model.named_parameters()]
        want = {
            n: torch.stack([r[k] for r in rows])
            if rows
            else before[n].new_zeros((0, *before[n].shape))
            for k, n in enumerate(names)
        }
        private.backward(loss_of(model, *batch))
        assert private.step()
        _sgd_step_is_the_clipped_mean(model, before, clipped_mean(want, max_norm, expected_batch_size),
                                      lr, f"step {steps} (batch of {size})")  # fmt: skip
        steps += 1
    return steps


class SampleConvNet(nn.Module):
    """Opacus ``examples/mnist.py``'s ``SampleConvNet`` (16 and 32 channels shrunk to 3 and 4,
    28x28 images kept so that its shapes are the script's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(3, 4, 4, 2)
        self.fc1, self.fc2 = nn.Linear(4 * 4 * 4, 8), nn.Linear(8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)  # -> [B, 3, 13, 13]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)  # -> [B, 4, 4, 4]
        x = x.view(-1, 4 * 4 * 4)
        return self.fc2(F.relu(self.fc1(x)))


def test_opacus_mnist_example_with_make_private():
    """Opacus ``examples/mnist.py`` (``SampleConvNet``, ``CrossEntropyLoss``, SGD) with
    ``gradhooks.make_private`` where the script calls ``PrivacyEngine.make_private``: Poisson
    batches of the dataset, every step the clipped per-example gradients' sum over the
    expected batch size (noise off, to compare), applied by SGD."""
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = SampleConvNet().to(D)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(24, 1, 28, 28, generator=g, dtype=D), torch.randint(10, (24,), generator=g)
    )
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, delta=1e-5, max_grad_norm=1.0,
        noise_multiplier=0.0, steps=3, expected_batch_size=4, generator=torch.Generator().manual_seed(1),
    )  # fmt: skip

    def losses(m, x, y):
        return F.cross_entropy(m(x), y, reduction="none")

    try:
        assert _run_private(model, private, losses, 0.1, 4, 1.0) == 3
    finally:
        private.close()


class CharNNClassifier(nn.Module):
    """Opacus ``examples/char-lstm-classification.py``'s classifier: an Embedding, an LSTM
    (``DPLSTM`` there; ``nn.LSTM`` here, which gradhooks hooks as it is), batch first, the last
    time step's output (padding included, as the script takes it), a Linear."""

    def __init__(self, vocab: int = 9, embedding_size: int = 4, hidden_size: int = 5, out: int = 3):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embedding_size)
        self.rnn = nn.LSTM(embedding_size, hidden_size, num_layers=1, batch_first=True)
        self.out_layer = nn.Linear(hidden_size, out)

    def forward(self, x, hidden=None):
        x, _ = self.rnn(self.embedding(x), hidden)
        return self.out_layer(x[:, -1, :])


def padded_collate(batch, padding_idx=0):
    """The Opacus examples' ``padded_collate``: names of different lengths padded."""
    x = nn.utils.rnn.pad_sequence(
        [e[0] for e in batch], batch_first=True, padding_value=padding_idx
    )
    return x, torch.stack([e[1] for e in batch]).long()


class Names(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int, classes: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [
            (torch.randint(1, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g),
             torch.randint(classes, (), generator=g))
            for _ in range(n)
        ]  # fmt: skip

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_opacus_char_lstm_classification_with_make_private_and_padded_collate():
    """Opacus ``examples/char-lstm-classification.py``: names padded by the loader's
    ``padded_collate`` (kept by ``make_private``), an LSTM classifier, SGD; each step's update
    is the clipped per-example gradients' mean over the expected batch size (noise off)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = CharNNClassifier().to(D)
    loader = DataLoader(Names(30, 9, 3), batch_size=8, collate_fn=padded_collate)
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loader, delta=1e-5, max_grad_norm=0.2,
        noise_multiplier=0.0, steps=3, expected_batch_size=5, generator=torch.Generator().manual_seed(2),
    )  # fmt: skip

    def losses(m, x, y):
        return F.cross_entropy(m(x), y, reduction="none")

    try:
        assert _run_private(model, private, losses, 0.5, 5, 0.2) == 3
    finally:
        private.close()


class SampleNet(nn.Module):
    """Opacus ``examples/imdb.py``'s ``SampleNet``: an Embedding, averaged over the tokens by
    ``AdaptiveAvgPool1d`` on the transposed embeddings, ``squeeze()``, two Linear layers."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 6)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        x = self.pool(self.emb(x).transpose(1, 2)).squeeze()
        return self.fc2(F.relu(self.fc1(x)))


def test_opacus_imdb_example_embedding_mean_pooled_with_make_private():
    """Opacus ``examples/imdb.py``: token ids padded by ``padded_collate``, an Embedding
    mean-pooled by ``AdaptiveAvgPool1d``, Adam in the script (SGD here, to check the update),
    each step the clipped per-example gradients' mean (noise off). A batch of one, which
    Poisson sampling draws, loses its batch dimension to the model's ``squeeze()``: its
    Linear layers get ``[6]``, all of the one example's, and its norm is the float64 loop's
    (it was refused, naming ``fc2``, before the tracker followed a batch of one through
    them)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = SampleNet(9).to(D)
    loader = DataLoader(Names(30, 9, 2, seed=1), batch_size=8, collate_fn=padded_collate)
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loader, delta=1e-5, max_grad_norm=0.1,
        noise_multiplier=0.0, steps=3, expected_batch_size=6, generator=torch.Generator().manual_seed(3),
    )  # fmt: skip

    def losses(m, x, y):
        return F.cross_entropy(m(x).view(-1, 2), y, reduction="none")

    try:
        assert _run_private(model, private, losses, 0.5, 6, 0.1) == 3
    finally:
        private.close()
    # The script's squeeze() takes the batch dimension away from a (Poisson) batch of one.
    x, y = padded_collate([Names(1, 9, 2, seed=4)[0]])
    want = loop_grad(model, lambda out, t: F.cross_entropy(out.view(-1, 2), t), x, y)
    norm = torch.sqrt(sum(g.square().sum() for g in want.values())).reshape(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        got = gradhooks.dp_sgd_step(h, losses(model, x, y), max_norm=0.1, noise_multiplier=0.0)
    torch.testing.assert_close(got, norm, rtol=1e-9, atol=1e-12)


NZ, NGF, NDF = 3, 2, 2


class DCGANGenerator(nn.Module):
    """Opacus ``examples/dcgan.py``'s generator: five transposed convolutions from a ``[nz,
    1, 1]`` noise to a 64x64 image, GroupNorm (the script's) between them (``ngf``, ``ndf``
    shrunk to 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 8, 4, 1, 0, bias=False),
            nn.GroupNorm(min(32, NDF * 8), NDF * 8), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 8, NGF * 4, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, NDF * 4), NDF * 4), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, NDF * 2), NDF * 2), nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, NDF), NDF), nn.ReLU(True),
            nn.ConvTranspose2d(NGF, 1, 4, 2, 1, bias=False), nn.Tanh(),
        )  # fmt: skip

    def forward(self, input):
        return self.main(input)


class DCGANDiscriminator(nn.Module):
    """Opacus ``examples/dcgan.py``'s discriminator: five strided convolutions to one
    probability per image, GroupNorm in place of the PyTorch example's BatchNorm;
    ``output.view(-1, 1).squeeze(1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, NDF * 2), NDF * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, NDF * 4), NDF * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 4, NDF * 8, 4, 2, 1, bias=False),
            nn.GroupNorm(min(32, NDF * 8), NDF * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )  # fmt: skip

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def _weights_init(m):
    if "Conv" in type(m).__name__:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif "GroupNorm" in type(m).__name__:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def test_opacus_dcgan_private_discriminator_and_the_generator_step_through_it():
    """Opacus ``examples/dcgan.py``: only the discriminator is private (``make_private`` on
    it, Poisson batches of real images). Its step: a forward on the real batch and one on
    ``netG(noise).detach()``, the per-example losses ``BCE(real_i, 1) + BCE(fake_i, 0)`` (the
    script's ``errD_real + errD_fake`` per example), ``private.backward``, ``private.step``:
    the update is the clipped mean of each pair's own gradient (noise off). Then the
    generator's step backpropagates through the hooked discriminator (``errG.backward()``,
    Adam on the generator): the discriminator's next private step is still its own batch's."""
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    netG, netD = DCGANGenerator().to(D), DCGANDiscriminator().to(D)
    netG.apply(_weights_init)
    netD.apply(_weights_init)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(12, 1, 64, 64, generator=g, dtype=D) * 2 - 1)
    private = gradhooks.make_private(
        netD, torch.optim.SGD(netD.parameters(), lr=0.5), data, delta=1e-5, max_grad_norm=0.05,
        noise_multiplier=0.0, steps=3, expected_batch_size=3, generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def errD(m, real, fake):
        bce = nn.BCELoss(reduction="none")
        out_real, out_fake = m(real), m(fake)
        return bce(out_real, torch.ones_like(out_real)) + bce(out_fake, torch.zeros_like(out_fake))

    steps = 0
    try:
        for (real,) in private.batches():
            fake = netG(torch.randn(real.shape[0], NZ, 1, 1, generator=g, dtype=D))
            batch = (real, fake.detach())
            before = {n: p.detach().clone() for n, p in netD.named_parameters()}
            with gradhooks.paused():
                rows = [torch.autograd.grad(errD(netD, *(t[i : i + 1] for t in batch)).sum(),
                                            list(netD.parameters()))
                        for i in range(real.shape[0])]  # fmt: skip
            want = {n: (torch.stack([r[k] for r in rows]) if rows else p.new_zeros((0, *p.shape)))
                    for k, (n, p) in enumerate(before.items())}  # fmt: skip
            private.backward(errD(netD, *batch))
            assert private.step()
            _sgd_step_is_the_clipped_mean(netD, before, clipped_mean(want, 0.05, 3), 0.5,
                                          f"discriminator step {steps}")  # fmt: skip
            optimizerG.zero_grad()
            output_g = netD(fake)
            nn.BCELoss()(output_g, torch.ones_like(output_g)).backward()
            optimizerG.step()
            steps += 1
    finally:
        private.close()
    assert steps == 3


# -- pytorch/examples fast_neural_style ------------------------------------------------------------


class ConvLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.in2(self.conv2(self.relu(self.in1(self.conv1(x))))) + x


class UpsampleConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        if self.upsample:
            x = F.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x))


class TransformerNet(nn.Module):
    """pytorch/examples ``fast_neural_style/neural_style/transformer_net.py``: reflection-
    padded convolutions, affine InstanceNorm, residual blocks (five there, two here), nearest
    upsampling then convolution (32-64-128 channels shrunk to 3-4-4)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = ConvLayer(3, 3, kernel_size=9, stride=1)
        self.in1 = nn.InstanceNorm2d(3, affine=True)
        self.conv2 = ConvLayer(3, 4, kernel_size=3, stride=2)
        self.in2 = nn.InstanceNorm2d(4, affine=True)
        self.conv3 = ConvLayer(4, 4, kernel_size=3, stride=2)
        self.in3 = nn.InstanceNorm2d(4, affine=True)
        self.res1, self.res2 = ResidualBlock(4), ResidualBlock(4)
        self.deconv1 = UpsampleConvLayer(4, 4, kernel_size=3, stride=1, upsample=2)
        self.in4 = nn.InstanceNorm2d(4, affine=True)
        self.deconv2 = UpsampleConvLayer(4, 3, kernel_size=3, stride=1, upsample=2)
        self.in5 = nn.InstanceNorm2d(3, affine=True)
        self.deconv3 = ConvLayer(3, 3, kernel_size=9, stride=1)
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.relu(self.in3(self.conv3(y)))
        y = self.res2(self.res1(y))
        y = self.relu(self.in4(self.deconv1(y)))
        y = self.relu(self.in5(self.deconv2(y)))
        return self.deconv3(y)


class Vgg16(nn.Module):
    """``fast_neural_style/neural_style/vgg.py``'s frozen feature extractor, a namedtuple of
    four ReLU outputs of successive slices (VGG-16's pretrained weights replaced by a small
    random network)."""

    def __init__(self) -> None:
        super().__init__()
        conv = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU())  # noqa: E731
        self.slice1 = conv(3, 3)
        self.slice2 = nn.Sequential(nn.MaxPool2d(2), conv(3, 4))
        self.slice3 = nn.Sequential(nn.MaxPool2d(2), conv(4, 4))
        self.slice4 = nn.Sequential(nn.MaxPool2d(2), conv(4, 5))
        for p in self.parameters():
            p.requires_grad = False

    def forward(self, X):
        h1 = self.slice1(X)
        h2 = self.slice2(h1)
        h3 = self.slice3(h2)
        return SimpleNamespace(relu1_2=h1, relu2_2=h2, relu3_3=h3, relu4_3=self.slice4(h3))


def gram_matrix(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


def normalize_batch(batch):
    """``utils.normalize_batch``: divides ``batch`` by 255 in place, then normalizes."""
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std


def test_fast_neural_style_perceptual_loss_through_a_frozen_network():
    """pytorch/examples ``fast_neural_style/neural_style/neural_style.py``'s ``train``: the
    transformer's output and its input each normalized *in place* (``div_(255)``), both
    through a frozen VGG, a content loss on one feature map and a style loss between Gram
    matrices and the style image's, weighted 1e5 and 1e10, Adam. grad1 is each image's own
    gradient (to 1e-12 of the largest: a convolution's bias before an InstanceNorm has a
    gradient of zero, left as rounding of the 1e10-weighted terms); the frozen VGG has none."""
    torch.manual_seed(0)
    transformer, vgg = TransformerNet().to(D), Vgg16().to(D)
    g = torch.Generator().manual_seed(0)
    style = (torch.rand(1, 3, 8, 8, generator=g, dtype=D) * 255).repeat(4, 1, 1, 1)
    f = vgg(normalize_batch(style))
    gram_style = [gram_matrix(y) for y in (f.relu1_2, f.relu2_2, f.relu3_3, f.relu4_3)]
    mse_loss = nn.MSELoss()
    optimizer = torch.optim.Adam(transformer.parameters(), 1e-3)

    def total_loss(x):
        n_batch = len(x)
        y = normalize_batch(transformer(x))
        x = normalize_batch(x)
        features_y, features_x = vgg(y), vgg(x)
        content_loss = 1e5 * mse_loss(features_y.relu2_2, features_x.relu2_2)
        style_loss = 0.0
        fy = (features_y.relu1_2, features_y.relu2_2, features_y.relu3_3, features_y.relu4_3)
        for ft_y, gm_s in zip(fy, gram_style):
            style_loss += mse_loss(gram_matrix(ft_y), gm_s[:n_batch, :, :])
        return content_loss + 1e10 * style_loss

    with gradhooks.add_hooks(transformer) as h:
        for step in range(2):
            x = torch.rand(3, 3, 8, 8, generator=g, dtype=D) * 255
            want = per_example(transformer, h, 3, lambda i, x=x: total_loss(x[i : i + 1].clone()))
            optimizer.zero_grad()
            total_loss(x).backward()
            scale = max(w.abs().max().item() for w in want.values())
            assert_grad1(transformer, want, f"step {step}", rtol=1e-7, atol=1e-12 * scale)
            optimizer.step()
    assert all(not hasattr(p, "grad1") for p in vgg.parameters())


# -- lucidrains/x-transformers train_enwik8.py -----------------------------------------------------


def test_x_transformers_enwik8_autoregressive_wrapper_with_accumulation_and_generation():
    """lucidrains/x-transformers ``train_enwik8.py``: a ``TransformerWrapper`` decoder with
    rotary embeddings and orthogonally projected values in an ``AutoregressiveWrapper``,
    whose forward takes the sequences and returns the next-token loss; ``(loss /
    GRADIENT_ACCUMULATE_EVERY).backward()`` over micro-batches, ``clip_grad_norm_(0.5)``,
    Adam, a validation loss under ``no_grad`` in eval mode, and ``model.generate`` with the
    KV cache between steps. After the micro-batches, each grad1 row is the sum of that
    row's own gradients over them, divided by their number. Tolerance: x-transformers applies
    the rotary embedding in float32 (``t.float()``), so an example alone and the same
    example in a batch differ by float32 rounding: 1e-6 of the largest gradient."""
    xt = pytest.importorskip("x_transformers")
    from x_transformers.autoregressive_wrapper import AutoregressiveWrapper

    torch.manual_seed(0)
    net = xt.TransformerWrapper(
        num_tokens=11, max_seq_len=8,
        attn_layers=xt.Decoder(dim=8, depth=1, heads=2, rotary_pos_emb=True,
                               attn_orthog_projected_values=True,
                               attn_orthog_projected_values_per_head=True),
    )  # fmt: skip
    model = AutoregressiveWrapper(net).to(D)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    accumulate = 2
    g = torch.Generator().manual_seed(0)

    def own_loss(i, x):
        logits = net(x[i : i + 1])[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), x[i : i + 1, 1:]) / accumulate

    with gradhooks.add_hooks(model) as h:
        for i in range(2):
            model.train()
            want = None
            for _ in range(accumulate):
                x = torch.randint(0, 11, (3, 7), generator=g)
                rows = per_example(model, h, 3, lambda k, x=x: own_loss(k, x))
                want = rows if want is None else {n: want[n] + rows[n] for n in rows}
                loss = model(x)
                (loss / accumulate).backward()
            scale = max(w.abs().max().item() for w in want.values())
            assert_grad1(model, want, f"batch {i}", rtol=1e-6, atol=1e-6 * scale)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optim.step()
            optim.zero_grad()
            model.eval()
            with torch.no_grad():
                model(torch.randint(0, 11, (2, 7), generator=g)).item()
            sample = model.generate(prompts=torch.randint(0, 11, (3,), generator=g), seq_len=4,
                                    cache_kv=True)  # fmt: skip
            assert sample.shape == (4,)
            assert model.net.to_logits.weight.grad1.shape[0] == 3  # generation captured nothing


# -- pytorch/examples word_language_model, the Transformer model -----------------------------------


class TransformerModel(nn.Transformer):
    """pytorch/examples ``word_language_model/model.py``'s ``TransformerModel``: a subclass of
    ``nn.Transformer`` with its own ``forward`` (only the encoder used, its ``decoder``
    attribute replaced by a Linear to the vocabulary), the causal mask ``log(tril(ones))``
    cached on the module and rebuilt when the sequence length changes, the embedding scaled
    by ``sqrt(ninp)``, log_softmax. The dropouts (0.1 in ``nn.Transformer``, 0.5 in the
    positional encoding) are 0: their masks cannot be drawn again by a loop."""

    def __init__(self, ntoken: int = 11, ninp: int = 8, nhead: int = 2, nhid: int = 12) -> None:
        super().__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=1,
                         num_decoder_layers=1, dropout=0.0)  # fmt: skip
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, 0.0)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        nn.init.uniform_(self.input_emb.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, src, has_mask=True):
        if has_mask:
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                self.src_mask = torch.log(torch.tril(torch.ones(len(src), len(src), dtype=D)))
        else:
            self.src_mask = None
        src = self.pos_encoder(self.input_emb(src) * math.sqrt(self.ninp))
        return F.log_softmax(self.decoder(self.encoder(src, mask=self.src_mask)), dim=-1)


def test_word_language_model_transformer_subclass_with_a_cached_mask():
    """pytorch/examples ``word_language_model/main.py`` with ``--model Transformer``:
    ``[bptt, batch]`` batches (``batch_dim=1``) from ``get_batch``, the last one shorter
    (the cached mask rebuilt), ``model.zero_grad()``, ``NLLLoss`` on ``output.view(-1,
    ntokens)``, ``clip_grad_norm_``, the update by hand. Each sequence's own gradient."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: nested tensors need batch_first)
        model = TransformerModel().to(D)
    criterion = nn.NLLLoss()
    data = torch.randint(11, (10, 3), generator=torch.Generator().manual_seed(0))
    bptt, lr = 4, 0.5
    with gradhooks.add_hooks(model, batch_dim=1) as h:
        for batch, i in enumerate(range(0, data.size(0) - 1, bptt)):
            seq_len = min(bptt, len(data) - 1 - i)
            x, targets = data[i : i + seq_len], data[i + 1 : i + 1 + seq_len]
            model.zero_grad()
            output = model(x).view(-1, 11)
            criterion(output, targets.reshape(-1)).backward()

            def own(k, x=x, targets=targets):
                return criterion(model(x[:, k : k + 1]).view(-1, 11), targets[:, k])

            assert_grad1(model, per_example(model, h, 3, own), f"batch {batch} (length {seq_len})")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-lr)


# -- pytorch/examples legacy/snli ------------------------------------------------------------------


class Bottle(nn.Module):
    def forward(self, input):
        if len(input.size()) <= 2:
            return super().forward(input)
        size = input.size()[:2]
        out = super().forward(input.view(size[0] * size[1], -1))
        return out.view(size[0], size[1], -1)


class BottleLinear(Bottle, nn.Linear):
    """``legacy/snli/model.py``'s ``Linear(Bottle, nn.Linear)``: an ``nn.Linear`` whose
    forward (``Bottle``'s) folds ``[seq, batch]`` into one dimension and back."""


class SNLIEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.rnn = nn.LSTM(input_size=config.d_proj, hidden_size=config.d_hidden,
                           num_layers=config.n_layers, bidirectional=config.birnn)  # fmt: skip

    def forward(self, inputs):
        batch_size = inputs.size()[1]
        h0 = c0 = inputs.new_zeros((self.config.n_cells, batch_size, self.config.d_hidden))
        outputs, (ht, ct) = self.rnn(inputs, (h0, c0))
        if not self.config.birnn:
            return ht[-1]
        return ht[-2:].transpose(0, 1).contiguous().view(batch_size, -1)


class SNLIClassifier(nn.Module):
    """pytorch/examples ``legacy/snli/model.py``: the forward takes the torchtext batch (an
    object whose attributes ``premise`` and ``hypothesis`` are ``[seq, batch]`` token ids),
    embeds both (``fix_emb``: detached), projects them with a ``Bottle`` Linear, encodes
    each with the same LSTM (bidirectional: both directions' last states side by side), and
    classifies the pair through a Sequential of ``Bottle`` Linear layers."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.n_embed, config.d_embed)
        self.projection = BottleLinear(config.d_embed, config.d_proj)
        self.encoder = SNLIEncoder(config)
        self.dropout, self.relu = nn.Dropout(p=config.dp_ratio), nn.ReLU()
        seq_in_size = 2 * config.d_hidden * (2 if config.birnn else 1)
        self.out = nn.Sequential(
            BottleLinear(seq_in_size, seq_in_size), self.relu, self.dropout,
            BottleLinear(seq_in_size, seq_in_size), self.relu, self.dropout,
            BottleLinear(seq_in_size, config.d_out),
        )  # fmt: skip

    def forward(self, batch):
        prem_embed, hypo_embed = self.embed(batch.premise), self.embed(batch.hypothesis)
        if self.config.fix_emb:
            prem_embed, hypo_embed = prem_embed.detach(), hypo_embed.detach()
        prem_embed = self.relu(self.projection(prem_embed))
        hypo_embed = self.relu(self.projection(hypo_embed))
        premise, hypothesis = self.encoder(prem_embed), self.encoder(hypo_embed)
        return self.out(torch.cat([premise, hypothesis], 1))


@pytest.mark.parametrize("birnn", [False, True], ids=["lstm", "bilstm"])
@pytest.mark.parametrize("fix_emb", [False, True], ids=["emb", "fixed-emb"])
def test_snli_classifier_given_the_torchtext_batch_object(birnn, fix_emb):
    """pytorch/examples ``legacy/snli/train.py``: ``answer = model(batch)`` with the batch
    object itself, ``CrossEntropyLoss`` against ``batch.label``, Adam; sequence first
    (``batch_dim=1``), premise and hypothesis of different lengths. The batch is followed
    from the tensors the object holds: each pair's own gradient (the Bottle Linear layers
    recomputed per example, the LSTM by its rule, run twice)."""
    config = SimpleNamespace(n_embed=11, d_embed=4, d_proj=5, d_hidden=3, n_layers=1,
                             birnn=birnn, n_cells=2 if birnn else 1, d_out=3, dp_ratio=0.0,
                             fix_emb=fix_emb)  # fmt: skip
    torch.manual_seed(0)
    model = SNLIClassifier(config).to(D)
    if fix_emb:
        model.embed.weight.requires_grad = False
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, batch_dim=1) as h:
        for step in range(2):
            batch = SimpleNamespace(premise=torch.randint(11, (5, 3), generator=g),
                                    hypothesis=torch.randint(11, (4, 3), generator=g),
                                    label=torch.randint(3, (3,), generator=g))  # fmt: skip
            opt.zero_grad()
            criterion(model(batch), batch.label).backward()

            def own(i, b=batch):
                one = SimpleNamespace(premise=b.premise[:, i : i + 1],
                                      hypothesis=b.hypothesis[:, i : i + 1])  # fmt: skip
                return criterion(model(one), b.label[i : i + 1])

            assert_grad1(model, per_example(model, h, 3, own), f"step {step}", frozen_clean=True)
            opt.step()


class MeanCentred(nn.Module):
    """Two Linear layers with the batch mean subtracted between them, given its input as an
    attribute of an object: what mixes the examples is refused as for a tensor input."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, batch):
        h = torch.tanh(self.l1(batch.x))
        return self.l2(h - h.mean(0))


def test_a_batch_mixed_after_coming_in_an_object_attribute_is_refused():
    """The examples reach the model inside an object (``batch.x``): the batch is followed from
    there, so the mean over it is refused (``MixedExamplesError`` naming the layer after it),
    where grad1 was silently wrong (nonzero where each example's own gradient, its centred
    activation being zero, is zero); no grad1 is left."""
    torch.manual_seed(0)
    model = MeanCentred().to(D)
    batch = SimpleNamespace(x=torch.randn(5, 3, dtype=D))
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'l2' \(Linear\)"):
            F.cross_entropy(model(batch), torch.randint(2, (5,))).backward()
    assert_untouched(model, "refused")


# -- pytorch/tutorials intermediate_source/reinforcement_q_learning.py ------------------------------


class DQN(nn.Module):
    """pytorch/tutorials ``intermediate_source/reinforcement_q_learning.py``'s Q-network on
    screen differences: three strided convolutions with BatchNorm2d, a Linear head (16 and 32
    channels shrunk to 4, 40x90 screens to 37x37)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, kernel_size=5, stride=2), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, kernel_size=5, stride=2), nn.BatchNorm2d(4)
        self.conv3, self.bn3 = nn.Conv2d(4, 4, kernel_size=5, stride=2), nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 2 * 2, 2)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        return self.head(x.view(x.size(0), -1))


def test_dqn_tutorial_batch_norm_refused_then_replay_steps_with_a_target_network():
    """pytorch/tutorials ``intermediate_source/reinforcement_q_learning.py``'s
    ``optimize_model``: a replay batch, ``policy_net(state_batch).gather(1, action_batch)``,
    the next states' values from the unhooked target network (zero where the episode ended,
    written through a boolean mask), ``smooth_l1_loss``, ``param.grad.data.clamp_(-1, 1)``,
    RMSprop; ``select_action`` runs the policy on one screen under ``no_grad`` in training
    mode. Its BatchNorm in training mode is refused naming ``bn1``. With the batch norms
    converted (``convert_batch_norm``, the target network loaded from the policy), each
    transition's own gradient; the clamp changes ``.grad``, not grad1."""
    torch.manual_seed(0)
    policy_net = DQN().to(D)
    g = torch.Generator().manual_seed(0)

    def replay(batch: int = 4):
        states = torch.randn(batch, 3, 37, 37, generator=g, dtype=D)
        actions = torch.randint(2, (batch, 1), generator=g)
        rewards = torch.ones(batch, dtype=D)
        non_final_mask = torch.tensor([True, False, True, True][:batch])
        next_states = torch.randn(int(non_final_mask.sum()), 3, 37, 37, generator=g, dtype=D)
        return states, actions, rewards, non_final_mask, next_states

    states, actions, *_ = replay()
    with gradhooks.add_hooks(policy_net):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'bn1' \(BatchNorm2d\)"):
            policy_net(states).gather(1, actions).sum().backward()
    assert_untouched(policy_net, "refused")

    policy_net = gradhooks.convert_batch_norm(policy_net)
    target_net = gradhooks.convert_batch_norm(DQN().to(D))
    target_net.load_state_dict(policy_net.state_dict())
    target_net.eval()
    optimizer = torch.optim.RMSprop(policy_net.parameters())
    with gradhooks.add_hooks(policy_net) as h:
        for step in range(3):
            with torch.no_grad():
                policy_net(torch.randn(1, 3, 37, 37, generator=g, dtype=D)).max(1)[1].view(1, 1)
            state_batch, action_batch, reward_batch, non_final_mask, non_final_next = replay()
            state_action_values = policy_net(state_batch).gather(1, action_batch)
            next_state_values = torch.zeros(4, dtype=D)
            next_state_values[non_final_mask] = target_net(non_final_next).max(1)[0].detach()
            expected = (next_state_values * 0.999) + reward_batch
            loss = F.smooth_l1_loss(state_action_values, expected.unsqueeze(1))
            optimizer.zero_grad()
            loss.backward()
            want = per_example(
                policy_net, h, 4,
                lambda i, s=state_batch, a=action_batch, e=expected: F.smooth_l1_loss(
                    policy_net(s[i : i + 1]).gather(1, a[i : i + 1]), e[i : i + 1].unsqueeze(1)),
            )  # fmt: skip
            assert_grad1(policy_net, want, f"step {step}")
            for param in policy_net.parameters():
                param.grad.data.clamp_(-1, 1)
            optimizer.step()
            if step == 1:
                target_net.load_state_dict(policy_net.state_dict())


# -- pytorch/examples regression/main.py -----------------------------------------------------------


def test_regression_example_a_bare_linear_fitted_until_its_loss_is_small():
    """pytorch/examples ``regression/main.py``: the model is one ``nn.Linear`` (hooked
    itself), polynomial features ``[x, x^2, x^3, x^4]``, ``fc.zero_grad()``,
    ``smooth_l1_loss``, the update by hand, until the loss is below 1e-3 (here, or 200
    batches); each batch's grad1 is its examples' own gradients (checked every 20th)."""
    torch.manual_seed(0)
    W_target, b_target = torch.randn(4, 1, dtype=D) * 5, torch.randn(1, dtype=D) * 5
    fc = nn.Linear(4, 1).to(D)
    g = torch.Generator().manual_seed(0)

    def get_batch(batch_size=8):
        x = torch.randn(batch_size, generator=g, dtype=D).unsqueeze(1)
        x = torch.cat([x**i for i in range(1, 5)], 1)
        return x, x.mm(W_target) + b_target.item()

    checked = 0
    with gradhooks.add_hooks(fc):
        for batch_idx in range(1, 201):
            batch_x, batch_y = get_batch()
            fc.zero_grad()
            output = F.smooth_l1_loss(fc(batch_x), batch_y)
            loss = output.item()
            if batch_idx % 20 == 1:
                want = loop_grad(fc, F.smooth_l1_loss, batch_x, batch_y)
            output.backward()
            if batch_idx % 20 == 1:
                assert_grad1(fc, want, f"batch {batch_idx}")
                checked += 1
            for param in fc.parameters():
                param.data.add_(-0.1 * param.grad)
            if loss < 1e-3:
                break
    assert checked >= 2
