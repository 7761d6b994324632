import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram import Amdahl, Estimate, Estimator

PROPERTY = settings(deadline=None, max_examples=60, derandomize=True)


def fraction(estimate: Estimate) -> float:
    """The learned parallel fraction (the estimator always fits Amdahl's law)."""
    assert isinstance(estimate.efficiency, Amdahl)
    return estimate.efficiency.parallel_fraction


def feed(
    estimator: Estimator,
    kind: str,
    truth: Estimate,
    n: int,
    *,
    seed: int = 0,
    noise: float = 0.0,
    units: tuple[int, ...] = (1, 2, 4, 8, 16),
) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        m = rng.choice(units)
        estimator.observe(kind, m, truth.seconds(m) * rng.uniform(1 - noise, 1 + noise))


@pytest.mark.parametrize(
    ("t1", "p"), [(10.0, 0.9), (3.0, 0.5), (100.0, 0.99), (0.2, 0.0), (5.0, 1.0), (40.0, 0.7)]
)
def test_learns_amdahl_from_exact_samples(t1: float, p: float) -> None:
    estimator = Estimator()
    feed(estimator, "k", Estimate(t1, Amdahl(p)), 300)
    learned = estimator.predict("k")
    assert learned.seconds_at_1 == pytest.approx(t1, rel=0.01)
    assert fraction(learned) == pytest.approx(p, abs=0.01)


@PROPERTY
@given(
    st.floats(min_value=0.05, max_value=500.0),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(0, 2**16),
)
def test_learns_amdahl_from_noisy_samples(t1: float, p: float, seed: int) -> None:
    # +-10% noise on every sample; the decayed fit still lands near the truth, and what it
    # predicts at each unit count is closer still (the split is what noise blurs).
    estimator = Estimator()
    truth = Estimate(t1, Amdahl(p))
    feed(estimator, "k", truth, 400, seed=seed, noise=0.1)
    learned = estimator.predict("k")
    assert learned.seconds_at_1 == pytest.approx(t1, rel=0.1)
    assert fraction(learned) == pytest.approx(p, abs=0.1)
    for m in (1, 4, 16):
        assert learned.seconds(m) == pytest.approx(truth.seconds(m), rel=0.08)


def test_prior_for_unseen_kind() -> None:
    estimator = Estimator(prior_seconds=7.0, prior_parallel_fraction=0.6)
    guess = estimator.predict("never")
    assert guess == Estimate(7.0, Amdahl(0.6))
    assert len(estimator) == 0  # predicting does not remember the kind


def test_one_sample_keeps_the_prior_split() -> None:
    # A single unit count cannot tell serial from parallel time: the prior's fraction
    # stays, and T1 blends the prior with the sample, each worth one sample.
    estimator = Estimator(prior_seconds=1.0, prior_parallel_fraction=0.8, decay=1.0)
    estimator.observe("k", 1, 10.0)
    guess = estimator.predict("k")
    assert fraction(guess) == pytest.approx(0.8)
    assert guess.seconds_at_1 == pytest.approx(5.5)


def test_one_sample_at_many_units_scales_t1() -> None:
    # 10 s on 4 units with p = 0.8 means T1 = 10 / (0.2 + 0.8 / 4) = 25 s; blended with
    # the prior's 0.4 s at 4 units the estimate is half way in time, 13 s at one unit.
    estimator = Estimator(prior_seconds=1.0, prior_parallel_fraction=0.8, decay=1.0)
    estimator.observe("k", 4, 10.0)
    guess = estimator.predict("k")
    assert fraction(guess) == pytest.approx(0.8)
    assert guess.seconds(4) == pytest.approx((10.0 + 0.4) / 2)


def test_many_samples_at_one_unit_count() -> None:
    estimator = Estimator(prior_parallel_fraction=0.3)
    for _ in range(500):
        estimator.observe("k", 4, 10.0)
    guess = estimator.predict("k")
    assert guess.seconds(4) == pytest.approx(10.0, rel=1e-3)
    assert fraction(guess) == pytest.approx(0.3, abs=1e-3)


def test_new_kind_starts_from_running_mean() -> None:
    estimator = Estimator(prior_seconds=1.0, decay=1.0)
    feed(estimator, "a", Estimate(20.0, Amdahl(0.5)), 200)
    fresh = estimator.predict("b")
    assert fresh.seconds_at_1 == pytest.approx(20.0, rel=0.1)
    assert fresh.seconds_at_1 != 1.0


def test_predicting_does_not_change_estimates() -> None:
    # Estimates are cached; whether a kind was asked for before other kinds were observed
    # must not show in what it predicts later.
    def run(ask_early: bool) -> Estimate:
        estimator = Estimator()
        estimator.observe("a", 2, 3.0)
        if ask_early:
            estimator.predict("a")
        feed(estimator, "b", Estimate(500.0, Amdahl(0.9)), 50)
        return estimator.predict("a")

    assert run(True) == run(False)


def test_decay_follows_a_change() -> None:
    estimator = Estimator(decay=0.9)
    feed(estimator, "k", Estimate(10.0, Amdahl(0.9)), 200, seed=1)
    assert estimator.predict("k").seconds_at_1 == pytest.approx(10.0, rel=0.02)
    feed(estimator, "k", Estimate(30.0, Amdahl(0.9)), 100, seed=2)
    assert estimator.predict("k").seconds_at_1 == pytest.approx(30.0, rel=0.02)


def test_no_decay_averages() -> None:
    # With decay 1.0 nothing is forgotten: after the same number of samples of each
    # regime the estimate sits between them.
    estimator = Estimator(decay=1.0)
    feed(estimator, "k", Estimate(10.0, Amdahl(0.9)), 200, seed=1, units=(1,))
    feed(estimator, "k", Estimate(30.0, Amdahl(0.9)), 200, seed=2, units=(1,))
    assert estimator.predict("k").seconds_at_1 == pytest.approx(20.0, rel=0.02)


def test_max_kinds_bounds_memory() -> None:
    estimator = Estimator(max_kinds=3, prior_seconds=1.0, decay=1.0)
    for kind, seconds in [("a", 50.0), ("b", 2.0), ("c", 3.0)]:
        estimator.observe(kind, 1, seconds)
    estimator.observe("a", 1, 50.0)  # "a" is now the most recently used
    estimator.observe("d", 1, 4.0)  # evicts "b", the least recently used
    assert len(estimator) == 3
    assert estimator.predict("a").seconds_at_1 > 20.0  # still learned
    mean_guess = estimator.predict("b").seconds_at_1
    assert mean_guess == estimator.predict("never-seen").seconds_at_1  # forgotten
    for i in range(1000):
        estimator.observe(f"kind-{i}", 1, 1.0)
    assert len(estimator) == 3


@pytest.mark.parametrize(
    ("units", "seconds"),
    [
        (1, math.nan),
        (1, -1.0),
        (1, math.inf),
        (0, 1.0),
        (-2, 1.0),
        (math.nan, 1.0),
        (math.inf, 1.0),
    ],
)
def test_ignores_bad_samples(units: float, seconds: float) -> None:
    estimator = Estimator()
    estimator.observe("k", 2, 4.0)
    before = estimator.predict("k")
    estimator.observe("k", units, seconds)
    after = estimator.predict("k")
    assert after == before
    assert math.isfinite(after.seconds_at_1)
    estimator.observe("fresh", units, seconds)
    assert len(estimator) == 1


def test_zero_seconds_is_a_sample() -> None:
    estimator = Estimator(decay=1.0)
    for _ in range(100):
        estimator.observe("k", 1, 0.0)
    guess = estimator.predict("k")
    assert 0 < guess.seconds_at_1 < 0.05  # floored above zero, near it


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prior_seconds": 0},
        {"prior_seconds": -1},
        {"prior_seconds": math.inf},
        {"prior_seconds": math.nan},
        {"prior_parallel_fraction": 1.5},
        {"prior_parallel_fraction": -0.1},
        {"prior_weight": 0},
        {"decay": 0},
        {"decay": 1.01},
        {"decay": True},
        {"max_kinds": 0},
        {"max_kinds": 2.5},
    ],
)
def test_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Estimator(**kwargs)  # type: ignore[arg-type]


@PROPERTY
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(1, 32),
            st.floats(min_value=0.0, max_value=1e4),
        ),
        max_size=60,
    )
)
def test_estimates_always_usable(samples: list[tuple[str, int, float]]) -> None:
    estimator = Estimator()
    for kind, units, seconds in samples:
        estimator.observe(kind, units, seconds)
        guess = estimator.predict(kind)
        assert math.isfinite(guess.seconds_at_1) and guess.seconds_at_1 > 0
        assert 0.0 <= fraction(guess) <= 1.0
