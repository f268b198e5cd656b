"""PipeDream graph.txt import: parsing, DAG linearisation, cut sizes, errors, CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dapple.cli import main
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler.pipedream import import_pipedream, linearise, parse_graph


def node(nid: str, desc: str, fwd: float, bwd: float, act: str | float, params: float) -> str:
    return (
        f"{nid} -- {desc} -- forward_compute_time={fwd:.3f}, backward_compute_time={bwd:.3f}, "
        f"activation_size={act}, parameter_size={params:.3f}"
    )


def edge(a: str, b: str) -> str:
    return f"\t{a} -- {b}"


def write(tmp_path: Path, lines: list[str], name: str = "graph.txt") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_chain(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        [
            node("node1", "Input0", 0, 0, 100.0, 0),
            node("node2", "Linear(in_features=4, out_features=8, bias=True)", 1.0, 2.0, 200.0, 160),
            node("node3", "ReLU()", 0.5, 0.25, 300.0, 0) + " -- stage_id=1",
            node("node4", "Linear(8, 2)", 0.2, 0.4, 50.0, 72),
            edge("node1", "node2"),
            edge("node2", "node3"),
            edge("node3", "node4"),
        ],
    )
    prof = import_pipedream(g, batch_size=2)
    assert [ly.name.split()[0] for ly in prof.layers] == ["node1", "node2", "node3", "node4"]
    assert [ly.output_bytes_per_sample for ly in prof.layers] == [50.0, 100.0, 150.0, 25.0]
    assert prof.layers[1].forward.per_sample_ms == 0.5 and prof.layers[1].backward.at(2) == 2.0
    assert [ly.parameter_bytes for ly in prof.layers] == [0, 160, 0, 72]
    assert prof.input_bytes_per_sample == 50.0
    assert prof.model_name == tmp_path.name and prof.batch_sizes == (2,)
    assert parse_graph(g.read_text()).nodes[2].stage_id == 1


def test_residual_branch_cut_sums(tmp_path: Path) -> None:
    # in -> a -> b -> c with a skip a -> c: the cut after b carries a's and b's outputs
    g = write(
        tmp_path,
        [
            node("n0", "Input0", 0, 0, 10.0, 0),
            node("n1", "Conv2d(a)", 1, 1, 1000.0, 4),
            node("n2", "Conv2d(b)", 1, 1, 700.0, 4),
            node("n3", "Add()", 1, 1, 1000.0, 0),
            node("n4", "Linear", 1, 1, 5.0, 8),
            edge("n0", "n1"),
            edge("n1", "n2"),
            edge("n1", "n3"),
            edge("n2", "n3"),
            edge("n3", "n4"),
        ],
    )
    prof = import_pipedream(g)
    assert [ly.output_bytes_per_sample for ly in prof.layers] == [10.0, 1000.0, 1700.0, 1000.0, 5.0]


def test_side_nodes_reordered_topologically(tmp_path: Path) -> None:
    # the file lists the View (n5) before Size (n6) it depends on; n3 is free and keeps its place
    g = write(
        tmp_path,
        [
            node("n1", "Input0", 0, 0, 64.0, 0),
            node("n2", "Linear", 1, 1, 128.0, 16),
            node("n5", "View(-1)", 0, 0, 128.0, 0),
            node("n3", "ReLU", 1, 1, 128.0, 0),
            node("n6", "Size(0)", 0, 0, 8.0, 0),
            node("n7", "Linear", 1, 1, 4.0, 16),
            edge("n1", "n2"),
            edge("n2", "n6"),
            edge("n2", "n5"),
            edge("n6", "n5"),
            edge("n5", "n3"),
            edge("n3", "n7"),
        ],
    )
    order = [n.node_id for n in linearise(parse_graph(g.read_text()))]
    assert order == ["n1", "n2", "n6", "n5", "n3", "n7"]
    prof = import_pipedream(g)
    # after n6: n2 (-> n5) and n6 (-> n5) are live
    assert [ly.output_bytes_per_sample for ly in prof.layers] == [
        64.0,
        128.0,
        136.0,
        128.0,
        128.0,
        4.0,
    ]


def test_several_inputs_and_list_sizes(tmp_path: Path) -> None:
    # GNMT-like: input1 (target ids) is only consumed by the decoder, so it crosses every cut
    g = write(
        tmp_path,
        [
            node("node1", "Input0", 0, 0, 400.0, 0),
            node("node2", "Input1", 0, 0, 8.0, 0),
            node("node3", "Input2", 0, 0, 400.0, 0),
            node("node4", "Embedding(100, 16)", 1, 2, 6400.0, 6400),
            node("node5", "LSTM(16, 16)", 3, 6, "[6400.0; 128.0; 128.0]", 4352),
            node("node6", "Decoder", 4, 8, 6400.0, 4352),
            edge("node1", "node4"),
            edge("node4", "node5"),
            edge("node2", "node5"),
            edge("node5", "node6"),
            edge("node3", "node6"),
        ],
    )
    prof = import_pipedream(g, batch_size=4)
    lstm = 6400.0 + 128.0 + 128.0
    expected = [
        400.0,  # node1 -> node4
        400.0 + 8.0,  # + node2 -> node5
        400.0 + 8.0 + 400.0,  # + node3 -> node6
        8.0 + 400.0 + 6400.0,  # node1 consumed; node4 -> node5
        400.0 + lstm,  # node3 and node5 -> node6
        6400.0,  # last node: its own output
    ]
    assert [ly.output_bytes_per_sample for ly in prof.layers] == [x / 4 for x in expected]
    assert prof.layers[4].kept_activation_bytes_per_sample == lstm / 4
    assert prof.input_bytes_per_sample == (400.0 + 8.0 + 400.0) / 4


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            "node9 -- Linear -- forward_compute_time=abc, backward_compute_time=1, activation_size=1, parameter_size=1",
            "not a number",
        ),
        (
            "node9 -- Linear -- forward_compute_time=1.0, backward_compute_time=1",
            "lacks activation_size",
        ),
        ("this is not a graph line", "not a node line"),
        ("\tnode1 node2", "malformed edge"),
        ("\tnode1 -- node77", "unknown node 'node77'"),
        (
            "node1 -- Dup -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1",
            "duplicate node",
        ),
        (
            "node9 -- X -- forward_compute_time=1, backward_compute_time=1, activation_size=[1; 2, parameter_size=1",
            "list",
        ),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, bad: str, message: str) -> None:
    g = write(tmp_path, [node("node1", "Input0", 0, 0, 1.0, 0), "", bad])
    with pytest.raises(ValidationError, match=message) as e:
        import_pipedream(g)
    assert "graph.txt:3" in str(e.value)


def test_cycle_names_nodes(tmp_path: Path) -> None:
    g = write(
        tmp_path,
        [
            node("a", "Input0", 0, 0, 1.0, 0),
            node("b", "X", 1, 1, 1.0, 0),
            node("c", "Y", 1, 1, 1.0, 0),
            node("d", "Z", 1, 1, 1.0, 0),
            edge("a", "b"),
            edge("b", "c"),
            edge("c", "b"),
            edge("c", "d"),
        ],
    )
    with pytest.raises(ValidationError, match=r"cycle through b, c, b"):
        import_pipedream(g)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = write(
        tmp_path,
        [
            node("node1", "Input0", 0, 0, 8.0, 0),
            node("node2", "Linear", 2, 4, 8.0, 40),
            edge("node1", "node2"),
        ],
        name="g.txt",
    )
    out = tmp_path / "p.json"
    assert main(["import-pipedream", str(g), "--output", str(out), "--batch-size", "2"]) == 0
    prof = ModelProfile.load(out)
    assert prof.model_name == "g" and prof.layers[1].forward.per_sample_ms == 1.0
    assert main(["import-pipedream", str(tmp_path / "missing.txt"), "-o", str(out)]) == 2
    assert main(["import-pipedream", str(g), "-o", str(out), "--batch-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot read PipeDream graph" in err and "--batch-size must be" in err


def test_pure() -> None:
    code = "import sys, dapple.profiler.pipedream; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
