"""The one-call entry points, `hebrus.generate` and `hebrus.stream_generate`: a model (or the
name of one, loaded with the text-level defaults of `text.generation`) and a prompt, text back.
They sit above `runtime`, which they load through; the rest of `text/` never imports it."""
from __future__ import annotations

from hebrus.errors import InvalidInput
from hebrus.runtime import Model, load as load_model
from hebrus.text.generation import DEVICE, DTYPE, MODE, TextStream, stream_text


def load(model, **options) -> Model:
    """`model` if it is a loaded one, else the model it names loaded with the text-level
    defaults (fast mode, device and dtype "auto")."""
    from hebrus.parallel import ParallelModel
    if isinstance(model, (Model, ParallelModel)):
        if options:
            raise InvalidInput(f"{', '.join(sorted(options))}: options for loading; this model is loaded already")
        return model
    return load_model(model, **{"mode": MODE, "device": DEVICE, "dtype": DTYPE, **options})


def stream_generate(model, prompt, **options) -> TextStream:
    """A new session of `model` (a loaded model, or a name loaded with the text-level defaults)
    continuing `prompt` (text, or a conversation as a list of {"role", "content"} dicts): the
    text as it comes. Options: max_new_tokens, temperature, top_p, top_k, min_p,
    repetition_penalty, seed, stop, grammar (see `TextOptions`; grammar: a
    `hebrus.text.grammar.Grammar` or a JSON schema as a dict, which the text then matches)."""
    model = load(model)
    return stream_text(model.session(), prompt, **options)


def generate(model, prompt, **options) -> str:
    """`stream_generate`'s whole text."""
    return stream_generate(model, prompt, **options).text()
