"""The developer tools: the README build compares text that does not depend on how the kernel chunked its output."""
import importlib.util
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown(outputs):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('a'); print('b')", outputs=outputs)])
    return MarkdownExporter().from_notebook_node(nb)[0]


def test_stream_chunks_are_joined_before_rendering():
    build = load("build_readme")
    stream = lambda name, text: nbformat.v4.new_output("stream", name=name, text=text)
    one = [stream("stdout", "line one\nline two\n")]
    split = [stream("stdout", "line one\n"), stream("stdout", "line two\n")]       # what a loaded kernel sends
    assert markdown(one) != markdown(split)                                          # the flake: a blank line more
    assert markdown(build.merge_streams(split)) == markdown(one)
    mixed = [stream("stdout", "a\n"), stream("stderr", "w\n"), stream("stdout", "b\n")]
    assert [o["name"] for o in build.merge_streams(mixed)] == ["stdout", "stderr", "stdout"]   # order across streams kept
    result = nbformat.v4.new_output("execute_result", data={"text/plain": "3"}, execution_count=1)
    assert len(build.merge_streams(split + [result] + split)) == 3
