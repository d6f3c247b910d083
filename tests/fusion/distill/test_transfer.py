"""The public transfer's augmentations: shifts of images and sequences, mixup, amplitude and noise."""

from __future__ import annotations

import numpy as np
import torch

from rayfuse.fusion.distill.transfer import augment_bank, shift_images, shift_sequences


def test_a_sequence_moves_along_its_steps_with_zero_padding():
    x = torch.arange(1.0, 7.0).view(1, 6, 1).repeat(50, 1, 2)  # 50 copies of steps 1..6, two features alike
    out = shift_sequences(x, 2, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and torch.equal(out[..., 0], out[..., 1])
    offsets = set()
    for row in out[..., 0].tolist():
        real = [v for v in row if v != 0]
        assert real == list(range(int(real[0]), int(real[-1]) + 1))  # consecutive steps, in order
        offsets.add(int(real[0]) - 1 if real[0] > 1 else -row.index(1.0))
    assert offsets == {-2, -1, 0, 1, 2}
    assert torch.equal(shift_sequences(x, 0, torch.Generator()), x)
    images = torch.ones(2, 1, 4, 4)
    assert torch.equal(shift_sequences(images, 2, torch.Generator()), images)  # only (N, L, D)


def test_without_scale_and_noise_the_image_bank_is_the_same_draws_as_before():
    X = torch.randn(20, 1, 6, 6)
    bank = augment_bank(X, 32, shift=1, mixup=0.5, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the earlier loop's draws, in its order
    first = shift_images(X[torch.randint(0, 20, (32,), generator=g)], 1, g)
    second = shift_images(X[torch.randint(0, 20, (32,), generator=g)], 1, g)
    lam = torch.rand(32, generator=g)
    lam = torch.where(torch.rand(32, generator=g) < 0.5, lam, torch.ones_like(lam)).view(-1, 1, 1, 1)
    torch.testing.assert_close(bank, lam * first + (1 - lam) * second, rtol=0, atol=0)


def test_scale_multiplies_each_input_and_noise_follows_each_elements_spread():
    ones = torch.ones(10, 8, 1)
    scaled = augment_bank(ones, 200, shift=0, mixup=0.0, scale=0.2, generator=torch.Generator().manual_seed(0))
    factors = scaled[:, 0, 0]
    assert torch.equal(scaled, factors.view(-1, 1, 1).expand_as(scaled))  # one factor an input
    assert 0.8 <= float(factors.min()) < 0.85 and 1.15 < float(factors.max()) <= 1.2
    signs = torch.from_numpy(np.random.default_rng(0).choice([-1.0, 1.0], size=(400, 30)).astype(np.float32))
    signs[:, 15:] *= 10  # the second half of the features spread ten times wider
    noisy = augment_bank(signs, 4000, shift=0, mixup=0.0, noise=0.05, generator=torch.Generator().manual_seed(1))
    residual = noisy - torch.where(noisy > 0, 1.0, -1.0) * torch.cat([torch.ones(15), torch.full((15,), 10.0)])
    assert abs(float(residual[:, :15].std()) - 0.05) < 0.005 and abs(float(residual[:, 15:].std()) - 0.5) < 0.05
