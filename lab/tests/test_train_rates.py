"""``python -m lab train``'s link arithmetic: the elastic paper's testbed
(ResNet-18 on CIFAR, two p3.2xlarge) and the tbf burst that goes with a rate.
Oracles: the published parameter count of CIFAR ResNet-18, FLOPs counted by
hand from the layer shapes, and the defining equation of the matched rate."""
import pytest

from lab.train import cli, elastic_rate


def test_resnet18_cifar_has_the_published_parameter_count():
    model = elastic_rate.resnet18_cifar()
    assert sum(p.numel() for p in model.parameters()) == 11_173_962


def _conv_flops_by_hand():
    """Forward FLOPs (2 per multiply-add) of every conv and the classifier of
    CIFAR ResNet-18 for one 32 x 32 image, and the first conv's share."""
    convs = [(3, 64, 3, 32)]                        # (cin, cout, k, output side)
    cin, side = 64, 32
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        side //= stride
        convs += [(cin, cout, 3, side), (cout, cout, 3, side)]
        if stride != 1 or cin != cout:
            convs.append((cin, cout, 1, side))      # projection shortcut
        convs += [(cout, cout, 3, side), (cout, cout, 3, side)]
        cin = cout
    fwd = [2 * ci * co * k * k * s * s for ci, co, k, s in convs] + [2 * 512 * 10]
    return sum(fwd), fwd[0]


def test_testbed_flops_match_a_count_by_hand():
    fwd, first = _conv_flops_by_hand()
    # backward: gradient of the weights and of the inputs, each as dear as the
    # forward -- except the first conv, whose input (the image) needs none
    per_image = 3 * fwd - first
    tb = elastic_rate.testbed()
    assert tb["step_flops"] == pytest.approx(per_image * 128, rel=1e-6)


def test_ratio_and_matched_rate_satisfy_their_definitions():
    tb = elastic_rate.testbed()
    n = 11_173_962
    wire = 2 * 1 * n * 4 / 2 * 8 / (10e9 * 0.81)                # P = 2 ring, 10 Gbit/s at 0.81
    compute = tb["step_flops"] / (15.7e12 * 0.6)
    assert tb["R"] == pytest.approx(wire / compute)
    assert tb["R_range"][0] < tb["R"] < tb["R_range"][1]
    ours = elastic_rate.ring_bytes(77_850, 2)
    assert ours == 77_850 * 4                                  # at P = 2 each worker sends N floats
    pr = elastic_rate.matched_rate(0.060, ours, tb)
    # the defining equation: our bytes on our link take R x our compute
    assert ours * 8 / (pr["rate_bits"] * 0.81) == pytest.approx(tb["R"] * 0.060)
    lo, hi = pr["rate_range_bits"]
    assert lo < pr["rate_bits"] < hi
    assert pr["rate"] == f"{round(pr['rate_bits'] / 1e3)}kbit"


@pytest.mark.parametrize("rate,expected", [("1gbit", "128kb"), ("3gbit", "128kb"), ("500mbit", "64kb"),
                                           ("50mbit", "16kb"), ("52500kbit", "16kb"), ("250mbit", "32kb")])
def test_auto_burst_is_one_gigabit_millisecond_scaled_with_the_rate(rate, expected):
    assert cli.burst_for(rate) == expected


def test_an_explicit_burst_is_kept_and_a_bad_rate_is_a_clear_error():
    assert cli.burst_for("50mbit", "128kb") == "128kb"
    with pytest.raises(SystemExit, match="unknown rate '50mbps'"):
        cli.burst_for("50mbps")
