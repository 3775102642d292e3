"""The pure limiter: windows, reservations settled by usage, class shares and loans."""

from __future__ import annotations

from thunderproxy.admission.limiter import Limiter
from thunderproxy.config.limits import ClassSpec, LimitsSpec, ModelLimits

FIXED = ClassSpec("interactive", 0.5, flexible=False)
FLEX_A = ClassSpec("batch", 0.25)
FLEX_B = ClassSpec("eval", 0.25)


def limiter(**limits: int) -> Limiter:
    spec = LimitsSpec({"m": ModelLimits(**limits)}, (FIXED, FLEX_A, FLEX_B), "interactive")
    return Limiter(spec)


def test_rpm_holds_in_a_minute_and_resets_with_the_next() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(rpm=2)}))
    klass = lim.spec.classes[0]
    for _ in range(2):
        assert lim.check("m", klass, 10, now=5.0).admitted
        lim.reserve("m", klass.name, 10, now=5.0)
    verdict = lim.check("m", klass, 10, now=59.9)
    assert not verdict.admitted
    assert verdict.dimension == "rpm"
    assert verdict.retry_at == 60.0
    assert lim.check("m", klass, 10, now=60.0).admitted


def test_tokens_count_the_reservation_and_settle_to_the_report() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(tpm=1000)}))
    klass = lim.spec.classes[0]
    res = lim.reserve("m", klass.name, 600, now=1.0)
    assert not lim.check("m", klass, 500, now=2.0).admitted
    settled = lim.settle(res, 200, now=3.0)
    assert settled.refund == 400
    assert settled.overage == 0
    assert lim.usage("m", klass.name).used("tpm", 3.0) == 200
    assert lim.check("m", klass, 800, now=3.0).admitted


def test_no_refund_after_the_window_closed_but_overage_always_counts() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(tpm=10_000)}))
    name = lim.spec.classes[0].name
    late = lim.reserve("m", name, 600, now=59.0)
    settled = lim.settle(late, 100, now=61.0)
    assert settled.late
    assert settled.refund == 0
    # The closed minute keeps its 600; the new minute owes nothing for it.
    assert lim.usage("m", name).used("tpm", 61.0) == 0
    over = lim.reserve("m", name, 100, now=119.0)
    settled = lim.settle(over, 400, now=121.0)
    assert settled.overage == 300
    assert lim.usage("m", name).used("tpm", 121.0) == 300
    # Within one day the day's count is settled exactly: 100 + 400.
    assert lim.usage("m", name).used("tpd", 121.0) == 500


def test_a_failed_call_keeps_its_reservation_but_stops_running() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(tpm=1000, concurrent=1)}))
    klass = lim.spec.classes[0]
    res = lim.reserve("m", klass.name, 700, now=1.0)
    assert lim.check("m", klass, 1, now=1.0).dimension == "concurrent"
    lim.settle(res, None, now=2.0)
    usage = lim.usage("m", klass.name)
    assert usage.used("tpm", 2.0) == 700
    assert usage.concurrent == 0


def test_a_fixed_class_keeps_its_share_and_never_borrows() -> None:
    lim = limiter(rpm=8)
    for _ in range(4):
        lim.reserve("m", FIXED.name, 1, now=0.0)
    verdict = lim.check("m", FIXED, 1, now=0.0)
    assert not verdict.admitted
    assert verdict.limit == 4
    # Flexible classes cannot take the fixed class's share either: 2 each, plus the other's 2.
    for _ in range(4):
        assert lim.check("m", FLEX_A, 1, now=0.0).admitted
        lim.reserve("m", FLEX_A.name, 1, now=0.0)
    assert not lim.check("m", FLEX_A, 1, now=0.0).admitted


def test_a_lender_with_demand_takes_its_share_back() -> None:
    lim = limiter(concurrent=8)
    lim.reserve("m", FLEX_A.name, 1, now=0.0)
    lim.reserve("m", FLEX_A.name, 1, now=0.0)
    # batch has used its 2; eval lends its unused 2 while eval has nobody waiting...
    assert lim.check("m", FLEX_A, 1, now=0.0).admitted
    # ...and lends nothing once eval has callers waiting.
    assert not lim.check("m", FLEX_A, 1, now=0.0, hungry={"eval"}).admitted
    assert lim.check("m", FLEX_B, 1, now=0.0).admitted


def test_the_instance_share_scales_every_limit() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(rpm=9)}))
    lim.share = 1 / 3
    klass = lim.spec.classes[0]
    for _ in range(3):
        lim.reserve("m", klass.name, 1, now=0.0)
    assert not lim.check("m", klass, 1, now=0.0).admitted


def test_a_call_bigger_than_the_capacity_can_never_fit() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(tpm=100)}))
    verdict = lim.check("m", lim.spec.classes[0], 500, now=0.0)
    assert verdict.never
    assert verdict.dimension == "tpm"


def test_unlimited_models_always_fit() -> None:
    lim = Limiter(LimitsSpec({"m": ModelLimits(rpm=1)}))
    assert lim.check("other", lim.spec.classes[0], 10**9, now=0.0).admitted


def test_a_backend_limit_holds_across_models_and_classes() -> None:
    spec = LimitsSpec(
        {"m": ModelLimits(rpm=100)},
        (FIXED, FLEX_A, FLEX_B),
        "interactive",
        backends={"gpu0": ModelLimits(rpm=3, tpm=1000)},
    )
    lim = Limiter(spec)
    lim.name_backend("http://gpu0", "gpu0")
    # Two models' calls, of two classes, count on the same backend.
    lim.reserve("m", "interactive", 100, now=1.0, backend="http://gpu0")
    lim.reserve("other", "batch", 100, now=1.0, backend="http://gpu0")
    assert lim.check_backend("http://gpu0", 100, now=2.0).admitted
    third = lim.reserve("m", "eval", 700, now=2.0, backend="http://gpu0")
    verdict = lim.check_backend("http://gpu0", 1, now=3.0)
    assert (verdict.admitted, verdict.dimension, verdict.retry_at) == (False, "rpm", 60.0)
    # Another backend, and one without limits, are not held by it.
    assert lim.check_backend("http://gpu1", 10_000, now=3.0).admitted
    assert lim.check_backend(None, 10_000, now=3.0).admitted
    # Settling refunds the backend's tokens as well as the model's.
    lim.settle(third, 100, now=4.0)
    assert lim.backend_usage("http://gpu0").used("tpm", 4.0) == 300
    assert lim.usage("m", "eval").used("tpm", 4.0) == 100
    assert lim.check_backend("http://gpu0", 1, now=60.0).admitted


def test_a_backend_limit_is_split_among_instances_and_can_never_fit() -> None:
    lim = Limiter(LimitsSpec({}, backends={"b": ModelLimits(tpm=1000, concurrent=2)}))
    lim.set_share(0.5)
    verdict = lim.check_backend("b", 600, now=0.0)
    assert (verdict.admitted, verdict.dimension, verdict.limit, verdict.never) == (
        False,
        "tpm",
        500.0,
        True,
    )
    lim.reserve("m", "default", 10, now=0.0, backend="b")
    verdict = lim.check_backend("b", 10, now=0.0)
    assert (verdict.admitted, verdict.dimension, verdict.retry_at) == (False, "concurrent", None)
