"""Ship rule: no ship before calibration; the bar follows the measured A/A noise."""
import random

from tkcc.agents.noise import NoiseModel


def test_uncalibrated_never_ships():
    ok, why = NoiseModel().decide(2.0, 1.0)
    assert not ok and "not yet measured" in why


def test_threshold_tracks_noise_and_false_ship_rate():
    rng = random.Random(0)
    for sd in (0.002, 0.02):
        nm = NoiseModel()
        for _ in range(50):
            a = 100 * (1 + rng.gauss(0, sd))
            b = 100 * (1 + rng.gauss(0, sd))
            nm.add_pair(a, b)
        assert nm.threshold() >= nm.floor
        # fresh A/A pairs from the same noise must almost never ship
        false = sum(nm.decide(100 * (1 + rng.gauss(0, sd)), 100 * (1 + rng.gauss(0, sd)))[0] for _ in range(2000))
        assert false / 2000 <= 0.01
        # a real gain of 10 noise sds (and over the floor) ships
        gain = max(10 * sd * 1.5, 2 * nm.floor)
        assert nm.decide(100 * (1 + gain), 100)[0]
