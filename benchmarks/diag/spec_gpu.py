"""Diagnose speculative decoding on the GPU: a prefix transaction's logits and state against the
same tokens fed one by one, and an int8 draft's greedy agreement with its bf16 model."""
import sys
import hebrus
from hebrus.bench.spec import workload

path = sys.argv[1]
model = hebrus.load(path, device="cuda", dtype="bfloat16", mode="fast")
prompt = workload(model.spec.vocab_size)
plain = model.session()
plain.prefill(prompt, 2048)
out = list(plain.generate([], max_new_tokens=9))
print("plain greedy", out)
for decode in ("eager", "auto"):
    one = model.session(decode=decode)
    one.prefill(prompt, 2048)
    steps = []
    for t in out:
        steps.append(one.feed([t]))
    pre = model.session(decode=decode)
    pre.prefill(prompt, 2048)
    k, logits = pre.feed_prefix(out, lambda logits: len(out))
    whole = model.session(decode=decode)
    whole.prefill(prompt, 2048)
    whole.feed(out)
    chunk_logits = whole.logits
    for i, step in enumerate(steps):
        rel = float((logits[i].float() - step.float()).abs().max() / step.float().abs().max())
        print(decode, "position", i, "rel", round(rel, 4), "argmax", int(logits[i].argmax()), int(step.argmax()),
              "next", out[i + 1] if i + 1 < len(out) else None)
    print("chunk vs steps last", float((chunk_logits.float() - steps[-1].float()).abs().max() / steps[-1].float().abs().max()))
    for name in ("layers.0.gdn.recurrent", "layers.0.gdn.conv", "residual"):
        a, b = pre.image.read(name).float(), one.image.read(name).float()
        print(decode, name, float((a - b).abs().max() / b.abs().max()))
draft = hebrus.load(path, device="cuda", dtype="bfloat16", mode="fast", quantize="int8")
ds = draft.session()
ds.prefill(prompt, 2048)
dout = list(ds.generate([], max_new_tokens=64))
pout = list(plain.generate([], max_new_tokens=55))
full = out + pout
print("int8 agreement", sum(a == b for a, b in zip(dout, full)), "of", len(full), "first diff",
      next((i for i, (a, b) in enumerate(zip(dout, full)) if a != b), None))
