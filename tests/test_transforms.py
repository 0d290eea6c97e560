"""Output transforms: checked at submit (the client's 400), applied to the
finished output (the producer's failure)."""

import pytest

from interlace.gateway.semantic.transforms import Transform, TransformFailed, TransformSpecError


def test_transforms_apply_in_order():
    t = Transform.parse({"strip": True, "json_field": "a.items.1", "regex": r"(\d+) (?P<unit>\w+)", "group": "unit"},
                        "t")
    assert t.apply('  {"a": {"items": ["x", "12 apples"]}}\n') == "apples"
    assert Transform.parse({"json_field": "n"}, "t").apply('{"n": {"k": [1, 2]}}') == '{"k": [1, 2]}'
    assert Transform.parse({"regex": "```python\n(.*?)```", "group": 1}, "t").apply(
        "Sure:\n```python\nprint(1)\n```") == "print(1)\n"
    assert Transform.parse(None, "t") is None


@pytest.mark.parametrize("spec", [{"strip": "yes"}, {"json_field": ""}, {"regex": "("}, {"regex": "a", "group": 2},
                                  {"regex": "(a)", "group": "name"}, {"group": 1}, {"regex": "a" * 600},
                                  {"upper": True}, "strip"])
def test_bad_specs_are_the_clients_mistake(spec):
    with pytest.raises(TransformSpecError):
        Transform.parse(spec, "outputs.x.transform")


@pytest.mark.parametrize("spec,text,why", [({"json_field": "a"}, "not json", "not JSON"),
                                          ({"json_field": "a.b"}, '{"a": 1}', "no 'b'"),
                                          ({"json_field": "a.5"}, '{"a": [1]}', "no '5'"),
                                          ({"regex": r"\d+"}, "none here", "does not match"),
                                          ({"regex": r"(x)|y", "group": 1}, "y", "did not take part")])
def test_outputs_that_do_not_fit_fail_the_producer(spec, text, why):
    with pytest.raises(TransformFailed, match=why):
        Transform.parse(spec, "t").apply(text)
