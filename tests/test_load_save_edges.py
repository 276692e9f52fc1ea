"""Loading and saving at the edges: odd paths, the working directory, names from untrusted
files, weights that do not fit. Each test is a case that once got through."""
import pytest
import torch

import hebrus

class _Path:
    def __init__(self, value):
        self.value = value

    def __fspath__(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


@pytest.mark.parametrize("path", ["", _Path(b"/tmp"), _Path(RuntimeError("no")), b"/tmp", None, 3, "a\0b"])
def test_odd_paths_are_invalid_input(tiny, path):
    with pytest.raises(hebrus.InvalidInput):
        hebrus.load(path)
    with pytest.raises(hebrus.InvalidInput):
        tiny.save(path)


def test_save_refuses_paths_that_cannot_be_folders(tiny, tmp_path):
    (tmp_path / "afile").write_text("x")
    for path in (tmp_path / "afile" / "sub" / "ck", tmp_path / ("x" * 300)):
        with pytest.raises(hebrus.InvalidInput, match="cannot save"):
            tiny.save(path)
    assert (tmp_path / "afile").read_text() == "x"


def test_save_refuses_the_working_directory(tiny, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for path in (".", str(tmp_path), str(tmp_path.parent)):
        with pytest.raises(hebrus.InvalidInput, match="working directory"):
            tiny.save(path)
    assert (tmp_path / "notes.txt").read_text() == "mine" and tmp_path.is_dir()


def test_saved_files_are_readable_by_others(tiny, tmp_path):
    tiny.save(tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").stat().st_mode & 0o044 == 0o044


def test_preset_weights_do_not_depend_on_torch_defaults(tiny):
    reference = tiny.session()
    reference.feed([1, 2, 3])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = hebrus.load("tiny")
    finally:
        torch.set_default_dtype(previous)
    s = model.session()
    s.feed([1, 2, 3])
    assert s.digest() == reference.digest()


def test_names_from_an_untrusted_file_cannot_drive_the_terminal(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from hebrus.cli import main
    tiny.save(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["\x1b]0;owned\x07\x1b[2J\u202erab"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(hebrus.CheckpointError) as info:
        hebrus.load(tmp_path)
    assert "\x1b" not in str(info.value) and "\u202e" not in str(info.value)
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and "\\x1b" in err


def test_a_weight_that_does_not_fit_the_models_dtype_is_refused_at_load(tiny, tmp_path):
    """Finite in the file, infinite after the cast: every chunk would have been non-finite."""
    params = {k: v.clone() for k, v in tiny.named_parameters()}
    params["layers.0.gdn.out_proj.weight"][0, 0] = 1e5
    hebrus.Model(tiny.config, params).save(tmp_path)
    assert hebrus.load(tmp_path).session().feed([1]) is not None
    with pytest.raises(hebrus.InvalidInput, match="layers.0.gdn.out_proj.weight does not fit in torch.float16"):
        hebrus.load(tmp_path, dtype="float16")


def test_non_finite_weights_are_refused_when_a_model_is_built(tiny):
    params = {k: v.clone() for k, v in tiny.named_parameters()}
    params["norm.weight"][0] = float("nan")
    with pytest.raises(hebrus.InvalidInput, match="norm.weight holds NaN"):
        hebrus.Model(tiny.config, params)
