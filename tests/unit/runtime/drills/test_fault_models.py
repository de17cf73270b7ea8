"""The fault models of ``GemmFault.kind``: each corrupts what it says, and a drilled model
under ``protect()`` detects each where the GEMM screen can see it."""

import dataclasses

import pytest
import torch


import sdc_guard  # noqa: E402
from respond_helpers import closure_for, make_model  # noqa: E402
from sdc_guard import GemmFault  # noqa: E402
from sdc_guard.runtime.drills.fault_models import corrupt  # noqa: E402


def linear_outputs(fault: GemmFault, dtype: torch.dtype = torch.float32, calls: int = 1):
    """A real Linear layer's outputs, clean and drilled (``calls`` forward calls), and the drill."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 150).to(dtype)
    x = torch.randn(70, 24, dtype=dtype)
    clean = layer(x).detach()
    with sdc_guard.drill(layer, fault, seed=3) as injector:
        drilled = [layer(x).detach() for _ in range(calls)]
    return clean, drilled, injector


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def changed(clean: torch.Tensor, out: torch.Tensor) -> list[list[int]]:
    return ((bits_of(clean) != bits_of(out))).nonzero().tolist()


def test_default_is_one_top_exponent_bit_turned_on_as_before() -> None:
    clean, (out,), injector = linear_outputs(GemmFault(element=(5, 7)))
    assert changed(clean, out) == [[5, 7]] or bool(bits_of(clean)[5, 7] & (1 << 30))
    assert bool(bits_of(out)[5, 7] & (1 << 30)) and injector.injections[0].bit == 30
    assert injector.injections[0].kind == "bit" and injector.injections[0].bits == (30,)


def test_multi_bit_flips_exactly_those_bits_of_one_element() -> None:
    clean, (out,), injector = linear_outputs(GemmFault(element=(2, 140), bits=(3, 17, 29), direction="flip"))
    assert changed(clean, out) == [[2, 140]]
    assert int(bits_of(clean)[2, 140] ^ bits_of(out)[2, 140]) == (1 << 3) | (1 << 17) | (1 << 29)
    assert injector.injections[0].bits == (3, 17, 29) and injector.injections[0].elements == 1


@pytest.mark.parametrize("direction, state", [("on", 1), ("off", 0)])
def test_stuck_bit_holds_its_state_at_one_lane_of_every_call(direction: str, state: int) -> None:
    fault = GemmFault(kind="stuck", bit=4, direction=direction)
    clean, outs, injector = linear_outputs(fault, calls=3)
    assert fault.sticky and len(injector.injections) == 3
    lanes = {j.element for j in injector.injections}
    assert len(lanes) == 1  # one position, every call
    (r, c), = lanes
    for out in outs:
        assert all(pos == [r, c] for pos in changed(clean, out))
        assert (int(bits_of(out)[r, c]) >> 4) & 1 == state


def test_stuck_lane_is_the_same_position_in_every_gemm_of_the_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Linear(40, 40))
    x = torch.randn(50, 8)
    with sdc_guard.drill(model, GemmFault(kind="stuck", bit=0, direction="on"), seed=1) as injector:
        model(x)
    sites = [(j.site, j.element) for j in injector.injections]
    assert [s for s, _ in sites] == ["0", "1"] and sites[0][1] == sites[1][1]


@pytest.mark.parametrize("period", [8, 16, 32])
def test_rows_pattern_is_every_period_th_row_of_the_element_s_column_within_its_tile(period: int) -> None:
    fault = GemmFault(kind="rows", element=(37, 90), bit=31, direction="flip", period=period, tile=64)
    clean, (out,), injector = linear_outputs(fault)
    rows = [r for r in range(0, 64) if r % period == 37 % period and r < 70]
    assert changed(clean, out) == [[r, 90] for r in rows]  # tile rows 0..63 (the element's), column 90
    assert torch.equal(out[rows, 90], -clean[rows, 90]) and injector.injections[0].elements == len(rows)


def test_columns_pattern_is_every_period_th_column_of_the_element_s_row_within_its_tile() -> None:
    fault = GemmFault(kind="columns", element=(3, 130), bit=31, direction="flip", period=8, tile=(16, 128))
    clean, (out,), _ = linear_outputs(fault)
    # the tile holding column 130 spans columns 128..149 (clipped): 130, 138, 146
    assert changed(clean, out) == [[3, 130], [3, 138], [3, 146]]


def test_zeroed_tile_is_the_aligned_tile_holding_the_element_and_nothing_else() -> None:
    clean, (out,), injector = linear_outputs(GemmFault(kind="zero_tile", element=(65, 70), tile=(32, 64)))
    region = torch.zeros_like(out, dtype=torch.bool)
    region[64:70, 64:128] = True  # rows 64..95 clipped to the 70 rows, columns 64..127
    assert torch.all(out[region] == 0) and torch.equal(out[~region], clean[~region])
    assert injector.injections[0].elements == int((clean[region] != 0).sum())


def test_swapped_rows_exchange_row_and_row_xor_1_within_the_tile_s_columns() -> None:
    clean, (out,), injector = linear_outputs(GemmFault(kind="swap_rows", element=(10, 20), tile=64))
    assert torch.equal(out[10, :64], clean[11, :64]) and torch.equal(out[11, :64], clean[10, :64])
    assert torch.equal(out[10, 64:], clean[10, 64:]) and torch.equal(out[12:], clean[12:])
    assert injector.injections[0].elements == 128
    last, (out,), _ = linear_outputs(GemmFault(kind="swap_rows", element=(69, 0), tile=64))
    assert torch.equal(out[69, :64], last[68, :64])  # row 69 ^ 1 = 68


def test_nan_and_inf_replace_the_element_the_infinity_keeping_its_sign() -> None:
    clean, (out,), _ = linear_outputs(GemmFault(kind="nan", element=(1, 2)))
    assert torch.isnan(out[1, 2]) and changed(clean, out) == [[1, 2]]
    clean, (out,), _ = linear_outputs(GemmFault(kind="inf", element=(1, 2)))
    assert torch.isinf(out[1, 2]) and torch.sign(out[1, 2]) == torch.sign(clean[1, 2])


def test_bf16_outputs_take_their_own_bit_positions() -> None:
    clean, (out,), _ = linear_outputs(GemmFault(element=(0, 0), bits=(0, 14), direction="flip"), torch.bfloat16)
    assert int(bits_of(clean)[0, 0] ^ bits_of(out)[0, 0]) == (1 << 0) | (1 << 14)
    with pytest.raises(ValueError, match=r"bit: expected 0\.\.15 for torch.bfloat16, got 20"):
        linear_outputs(GemmFault(bit=20), torch.bfloat16)


def test_corruption_bumps_no_version_counter_as_hardware_would_not() -> None:
    t = torch.ones(4, 4)
    before = t._version
    done = corrupt(t, "zero_tile", (0, 0), tile=(2, 2))
    assert done.elements == 4 and t[:2, :2].sum() == 0 and t._version == before


@pytest.mark.parametrize("kwargs, error, message", [
    ({"kind": "burst"}, ValueError, r"kind: expected one of 'bit', 'stuck'.* got 'burst'"),
    ({"kind": 3}, ValueError, r"kind: expected one of .* got 3"),
    ({"bits": ()}, ValueError, r"bits: expected a non-empty tuple of distinct bit positions .* got \(\)"),
    ({"bits": (3, 3)}, ValueError, r"bits: expected .*distinct.* got \(3, 3\)"),
    ({"bits": (40,)}, ValueError, r"bits: expected .* 0\.\.31 .* got \(40,\)"),
    ({"bits": 3}, ValueError, r"bits: expected .* got 3"),
    ({"bits": (1,), "bit": 2}, ValueError, r"bits: expected bit or bits, not both, got bit=2 and bits=\(1,\)"),
    ({"kind": "stuck", "direction": "flip"}, ValueError, r"direction: expected 'on' .* or 'off' .* got 'flip'"),
    ({"kind": "zero_tile", "bit": 3}, ValueError, r"bit: expected None for kind 'zero_tile'.* got bit=3"),
    ({"kind": "nan", "bits": (3,)}, ValueError, r"bit: expected None for kind 'nan'"),
    ({"kind": "rows", "period": 0}, ValueError, r"period: expected a positive int .* got 0"),
    ({"kind": "rows", "period": True}, ValueError, r"period: expected a positive int .* got True"),
    ({"period": 8}, ValueError, r"period: expected None for kind 'bit' .* got 8"),
    ({"kind": "zero_tile", "tile": (0, 4)}, ValueError, r"tile: expected a positive int or a \(rows, columns\) pair"
                                                        r".* got \(0, 4\)"),
    ({"kind": "zero_tile", "tile": (4, 4, 4)}, ValueError, r"tile: .* got \(4, 4, 4\)"),
    ({"kind": "stuck", "tile": 16}, ValueError, r"tile: expected None for kind 'stuck' .* got 16"),
])
def test_bad_fault_model_arguments_name_the_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        GemmFault(**kwargs)


#: one fault of each model, sized so that the GEMM screen must see it (an exponent bit
#: turned on in a pattern, a whole tile zeroed, two rows of different tokens swapped)
VISIBLE = {
    "bits": GemmFault(bits=(30, 29), direction="on"),
    "stuck": GemmFault(kind="stuck", bit=30, direction="on"),
    "rows": GemmFault(kind="rows", bit=30, direction="on", period=8, tile=64),
    "columns": GemmFault(kind="columns", bit=30, direction="on", period=8, tile=64),
    "zero_tile": GemmFault(kind="zero_tile", tile=16),
    "swap_rows": GemmFault(kind="swap_rows", tile=64),
    "nan": GemmFault(kind="nan"),
    "inf": GemmFault(kind="inf"),
}


@pytest.mark.parametrize("kind", list(VISIBLE))
def test_a_drilled_model_under_protect_detects_each_fault_model_at_its_site(kind: str) -> None:
    fault = dataclasses.replace(VISIBLE[kind], site="blocks.0.fc1", phase="forward", step=2)
    model = make_model(layers=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    policy = sdc_guard.Policy(on_detection="log", on_persistent="log", on_repeated="log")
    with sdc_guard.drill(model, fault, seed=5) as injector, sdc_guard.protect(model, policy=policy) as guard:
        outcomes = [guard.optimizer_step(opt, closure_for(model, opt, step)) for step in range(4)]
    assert [o.detected for o in outcomes[:2]] == [False, False]  # clean steps: no false alarm
    assert outcomes[2].detected and {d.site for d in outcomes[2].detections} == {"blocks.0.fc1"}
    assert {d.phase for d in outcomes[2].detections} == {"forward"}
    assert [j.step for j in injector.injections][:1] == [2] and injector.injections[0].changed
    later = [j for j in injector.injections if j.step == 3]
    assert bool(later) == fault.sticky  # a stuck bit stays; the others were one upset
    assert outcomes[3].detected == any(j.changed for j in later)  # (a bit already 1 is stuck unseen)


@pytest.mark.slow  # torch.compile: seconds per model
@pytest.mark.parametrize("kind", ["zero_tile", "swap_rows", "rows"])
def test_fault_models_drill_the_compiled_route_too(kind: str, fresh_dynamo) -> None:
    fault = dataclasses.replace(VISIBLE[kind], site="blocks.0.fc1", phase="forward", step=1)
    model = make_model(layers=1)
    compiled = torch.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    policy = sdc_guard.Policy(on_detection="log", on_persistent="log", on_repeated="log")
    with sdc_guard.drill(model, fault, seed=5) as injector, sdc_guard.protect(model, policy=policy) as guard:
        outcomes = [guard.optimizer_step(opt, closure_for(compiled, opt, step)) for step in range(3)]
    assert [o.detected for o in outcomes] == [False, True, False]
    assert [(j.kind, j.site, j.step) for j in injector.injections] == [(kind, "blocks.0.fc1", 1)]
    assert {d.site for d in outcomes[1].detections} == {"blocks.0.fc1"}
