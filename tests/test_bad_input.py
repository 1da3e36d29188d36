"""Every kind of bad input gets its own error that names the problem (and the fix), and a failed
call leaves the Decoder as good as new."""
import logging

import pytest
import torch

import draftsman
from draftsman.verifier.sampling import SamplingParams
import tiny_models
from tiny_models import build_model_folder, build_tokenizer

CONTEXT = 256  # max_position_embeddings of the tiny models


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]  # (target_dir, draft_dir)


@pytest.fixture(scope="module")
def decoder(llama):
    """A target with a stateful drafter (its own KV cache), so a leak of state would show."""
    target, draft = llama
    return draftsman.load(config(target, drafter={"name": "draft_model", "path": str(draft), "k": 3},
                                 generation={"max_new_tokens": 8}))


def config(target, **sections):
    return {"target": {"path": str(target)}, **sections}


# ----------------------------------------------------------------------------- prompts

@pytest.mark.parametrize("call, message", [
    (dict(prompts=""), "prompt 0 is empty"),  # no BOS in the tiny tokenizer: "" encodes to []
    (dict(input_ids=[[]]), "prompt 0 is empty"),
    (dict(prompts=["a", "b\ud800"]), r"prompt 1 is not valid Unicode text: character 1 is '\\ud800', half of"),
    (dict(input_ids=[[5, 6], []]), "prompt 1 is empty"),
    (dict(prompts=[]), "no prompts given"),
    (dict(input_ids=[]), "no prompts given"),
    (dict(), "either prompts .* or input_ids"),
    (dict(prompts="def f(", input_ids=[[5]]), "not both"),
    (dict(input_ids=[[5] * CONTEXT]), f"{CONTEXT} tokens but the target's context is {CONTEXT} positions"),
    (dict(prompts="x = 1\n" * 200), f"the target's context is {CONTEXT} positions.*at most {CONTEXT - 1}"),
    (dict(input_ids=[[5, 100000]]), r"token ids \[100000\] outside the target's vocabulary \[0, 320\)"),
    (dict(input_ids=[[5, -1]]), r"token ids \[-1\] outside"),
    # Every token banned: id 0 came out, as if allowed, under greedy and sampling alike.
    (dict(input_ids=[[5]], bad_words_ids=[[t] for t in range(320)]),
     r"bad_words_ids ban every one of the target's 320 tokens on its own, leaving none to generate: ban fewer"),
    (dict(input_ids=[[5]], max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(input_ids=[[5]], max_new_tokens=4, min_new_tokens=5),
     r"min_new_tokens must be in \[0, max_new_tokens = 4\], got 5: raise max_new_tokens"),
    (dict(input_ids=[[5]], min_new_tokens=-1), r"min_new_tokens must be in \[0, max_new_tokens"),
    # A wrong type read as out of range, with "raise max_new_tokens" as the fix.
    (dict(input_ids=[[5]], max_new_tokens=3, min_new_tokens="1"), "min_new_tokens must be a whole number, got '1'$"),
    (dict(input_ids=[[5]], max_new_tokens=3, min_new_tokens=2.5), "min_new_tokens must be a whole number, got 2.5$"),
    (dict(input_ids=[[5]], temperature=-1.0), "temperature must be >= 0"),
    (dict(input_ids=[[5]], top_k=-2), r"top_k must be a positive integer, or 0, -1 or null \(no top-k\)"),
    (dict(input_ids=[[5]], top_k=True), "top_k must be a positive integer"),  # ran as top_k 1
    (dict(input_ids=[[5]], top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(input_ids=[[5]], min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(input_ids=[[5]], repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(input_ids=[[5]], presence_penalty=5.0), r"presence_penalty must be in \[-2, 2\]"),
    (dict(input_ids=[[5]], stop="\n"), "stop must be a list of strings"),
    # NaN passed every range check above and failed deep in sampling as an IndexError; an infinite
    # temperature turns a banned token's -inf logit into NaN; a string failed as a TypeError.
    (dict(input_ids=[[5]], temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(input_ids=[[5]], temperature=float("inf")), "temperature must be a finite number"),
    (dict(input_ids=[[5]], repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(input_ids=[[5]], top_p=float("nan")), "top_p must be a finite number"),
    (dict(input_ids=[[5]], temperature="0.7"), r"temperature must be a number, got '0.7' \(str\)"),
    (dict(input_ids=[[5]], temperature=True), r"temperature must be a number, got True \(bool\)"),
    (dict(input_ids=[[5], [6]], temperature=[0.5, float("nan")]), "temperature must be a finite number"),
    (dict(input_ids=[[5]], temperature=1.0, seed="42"), "seed must be a whole number, e.g. 0, got '42'"),
    (dict(input_ids=[[5]], temperature=1.0, seed=1.5), "seed must be a whole number"),
    # a client's 2**70 failed as torch's "Overflow when unpacking long long"
    (dict(input_ids=[[5]], temperature=1.0, seed=2**64), r"seed must be in \[-2\^63, 2\^64\)"),
    (dict(input_ids=[[5]], temperature=1.0, seed=-2**63 - 1), r"seed must be in \[-2\^63, 2\^64\)"),
    # one prompt's flat ids, the usual slip, failed as "'int' object is not iterable"
    (dict(input_ids=[5, 6, 7]), r"input_ids is a list of prompts, each a list of token ids: \[\[5, 6, 7\]\] for one "
                                r"prompt, got \[5, 6, 7\]"),
    (dict(input_ids=[[5.5, 6]]), r"input_ids: prompt 0 has \[5.5\], not token ids"),  # int() cut it to 5
    (dict(input_ids=[[5], ["6"]]), r"prompt 1 has \['6'\], not token ids"),
    (dict(input_ids=["def f("]), r"input_ids takes token ids, not text, got \['def f\('\]: encode it first"),
    (dict(input_ids="def f("), r"input_ids takes token ids, not text"),
    (dict(prompts=5), r"prompts is a string or a list of strings \(token ids go in input_ids"),
])
def test_bad_generate_calls_name_the_problem(decoder, call, message):
    with pytest.raises(ValueError, match=message):
        decoder.generate(**call)


def test_a_prompt_past_the_tokenizers_maximum_is_named_by_the_engine_alone(llama):
    """transformers' "Token indices sequence length is longer than the specified maximum ... will
    result in indexing errors" came first, about a limit the engine's own error then named."""
    decoder = draftsman.load(config(llama[0]))
    decoder.tokenizer.model_max_length = 8  # (a real tokenizer's: the target's context)
    said = []
    listener = logging.Handler()
    listener.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(listener)  # its loggers' parent; stderr is not theirs here
    try:
        with pytest.raises(ValueError, match="tokens but the target's context is"):
            decoder.generate("x = 1\n" * 200)
    finally:
        logging.getLogger("transformers").removeHandler(listener)
    assert not [message for message in said if "Token indices sequence length" in message]


def test_a_conversation_past_the_tokenizers_maximum_is_named_by_the_engine_alone(chat_target):
    """The same warning came first through the chat template (decoder.chat, `draftsman chat`)."""
    decoder = draftsman.load(config(chat_target[0]))
    decoder.tokenizer.model_max_length = 8
    said = []
    listener = logging.Handler()
    listener.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(listener)
    try:
        with pytest.raises(ValueError, match="tokens but the target's context is"):
            decoder.chat([{"role": "user", "content": "x = 1\n" * 200}])
    finally:
        logging.getLogger("transformers").removeHandler(listener)
    assert not [message for message in said if "Token indices sequence length" in message]


def test_token_ids_as_tensors_and_one_prompt_for_stream(decoder):
    """input_ids may be a 2-D tensor or array, or a list of 1-D ones (they were); stream() takes one
    prompt and says so when given several."""
    import numpy as np

    want = decoder.generate(input_ids=[[5, 6, 7]], max_new_tokens=4)
    for given in (torch.tensor([[5, 6, 7]]), np.array([[5, 6, 7]]), [torch.tensor([5, 6, 7])], [[5.0, 6, 7]]):
        assert decoder.generate(input_ids=given, max_new_tokens=4).token_ids == want.token_ids
    assert "".join(decoder.stream(input_ids=torch.tensor([5, 6, 7]), max_new_tokens=4)) == want.texts[0]
    with pytest.raises(ValueError, match=r"stream takes one prompt: input_ids=\[5, 6, 7\], got \[\[5\], \[6\]\]"):
        list(decoder.stream(input_ids=[[5], [6]], max_new_tokens=2))
    with pytest.raises(ValueError, match=r"stream's input_ids are one prompt's token ids, e.g. .*got 5"):
        list(decoder.stream(input_ids=5, max_new_tokens=2))  # was "'int' object is not iterable"
    with pytest.raises(ValueError, match="stream takes one prompt, as text, got .*call it once per prompt"):
        list(decoder.stream(["a", "b"], max_new_tokens=2))


def test_encode_and_with_drafter_take_the_short_forms(decoder):
    """encode("text") encoded one prompt per character; with_drafter("ngram") failed as a dict() error."""
    assert decoder.encode("def parse(") == decoder.encode(["def parse("]) and len(decoder.encode("def parse(")) == 1
    other = decoder.with_drafter("ngram")
    assert other.config["drafter"] == {"name": "ngram"}
    greedy = dict(max_new_tokens=6, temperature=0.0)
    assert other.generate("def parse(", **greedy).token_ids == decoder.generate("def parse(", **greedy).token_ids
    with pytest.raises(ValueError, match="with_drafter takes a drafter config, e.g.*or a drafter's name, got 5"):
        decoder.with_drafter(5)
    with pytest.raises(ValueError, match=r"the drafter section has options \['k'\] but no name"):
        decoder.with_drafter({"k": 4})  # was "unknown option(s) ['k'] for drafter 'none'"



def test_decode_names_what_is_not_one_row_of_token_ids(decoder):
    """decode("abc") failed with the tokenizer's "Can't extract `str` to `Vec`", decode([-1]) as an
    OverflowError, and decode([[5, 6]]) returned a list, not text."""
    import numpy as np

    want = decoder.decode([5, 6, 7])
    same_row = (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), (5, 6, 7))
    assert want and all(decoder.decode(row) == want for row in same_row)
    for bad in ("abc", [-1], [1.5], [None]):
        with pytest.raises(ValueError, match=r"decode takes one row of token ids \(whole numbers >= 0\), got"):
            decoder.decode(bad)
    for rows in ([[5, 6]], torch.tensor([[5, 6]])):
        with pytest.raises(ValueError, match=r"got several rows .*\[decoder.decode\(row\) for row in rows\]"):
            decoder.decode(rows)
    assert decoder.decode_token(5) == decoder.decode_token(np.int64(5)) == decoder.decode_token(torch.tensor(5))
    for bad in (-1, "5", 5.0, True, None):
        with pytest.raises(ValueError, match="decode_token takes one token id"):
            decoder.decode_token(bad)
    # An id past the vocabulary decoded as "", silently (ids of another model's tokenizer).
    vocab = decoder.engine.vocab_size
    with pytest.raises(ValueError, match=f"decode: token id {vocab} is outside the target's vocabulary of {vocab}"):
        decoder.decode([5, vocab])
    with pytest.raises(ValueError, match="decode_token: token id 99999 is outside the target's vocabulary"):
        decoder.decode_token(99999)
    assert decoder.decode([]) == "" and decoder.decode([vocab - 1]) == decoder.decode(torch.tensor([vocab - 1]))

def test_top_k_0_and_minus_1_mean_every_token_as_in_vllm(llama):
    """vLLM clients send top_k -1 for "no top-k" (HF uses 0); both were refused. They switch off a
    config's top-k too: the same seeded samples as a decoder without one."""
    target, _ = llama
    plain = draftsman.load(config(target))
    with_top_k = draftsman.load(config(target, sampling={"top_k": 2}))
    run = dict(input_ids=[[5, 6, 7], [8, 9]], max_new_tokens=12, temperature=1.0, seed=3)
    want = plain.generate(**run).token_ids
    assert with_top_k.generate(**run).token_ids != want  # (the config's top-k does change them)
    for off in (-1, 0):
        assert with_top_k.generate(**run, top_k=off).token_ids == want
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) == SamplingParams()  # one batch key
    import numpy as np  # (a top_k read from an array: np.int64(0) was refused, np.int64(5) kept its type)
    assert SamplingParams(top_k=np.int64(-1)) == SamplingParams(top_k=np.int64(0)) == SamplingParams()
    assert type(SamplingParams(top_k=np.int64(5)).top_k) is int


def test_a_prompt_one_short_of_the_context_gets_one_token(decoder):
    out = decoder.generate(input_ids=[[5] * (CONTEXT - 1)], max_new_tokens=8)
    assert len(out.token_ids[0]) == 1
    assert out.stats.finish_reasons == ["context"]


def test_errors_leave_the_decoder_as_good_as_new(decoder, llama):
    good = dict(prompts=["def parse(text):", "class Foo:"], max_new_tokens=8, temperature=0.9, seed=3)
    before = decoder.generate(**good)
    for bad in (dict(input_ids=[[5, 6], []]), dict(input_ids=[[5] * CONTEXT]), dict(prompts=""),
                dict(input_ids=[[5]], top_p=1.5), dict(input_ids=[[5]], max_new_tokens=0)):
        with pytest.raises(ValueError):
            decoder.generate(**bad)
    after = decoder.generate(**good)
    assert after.token_ids == before.token_ids
    # ... and the same as a decoder that never saw an error.
    fresh = draftsman.load(decoder.config).generate(**good)
    assert fresh.token_ids == before.token_ids


# ----------------------------------------------------------------------------- config keys

@pytest.mark.parametrize("raw, message", [
    ({"targt": {}}, r"unknown config key\(s\) \['targt'\]; valid top-level keys: "
                    r"\['drafter', 'generation', 'sampling', 'target'\]"),
    ({"target": {"dtyp": "float32"}}, r"unknown key\(s\) \['target.dtyp'\]; valid keys in 'target': "
                                      r"\['attn_implementation', 'device', 'dtype', 'path', 'recurrent_branches'\]"),
    ({"sampling": {"temprature": 1.0}}, r"\['sampling.temprature'\].*\['bad_words_ids', 'epsilon_cutoff', 'eta_cutoff', "
                                        r"'frequency_penalty', 'logit_bias', 'lossy_typical_acceptance', 'min_p', "
                                        r"'no_repeat_ngram_size', 'presence_penalty', 'repetition_penalty', "
                                        r"'structured_output', 'temperature', 'top_h', 'top_k', 'top_p', "
                                        r"'typical_p'\]"),
    ({"generation": {"max_tokens": 9}}, r"\['generation.max_tokens'\].*\['ignore_eos', 'max_new_tokens', 'min_new_tokens', 'seed', 'stop', 'stop_token_ids'\]"),
    ({"sampling": 0.5}, "section 'sampling' must be a mapping"),
])
def test_unknown_config_keys_are_named_with_the_valid_ones(llama, raw, message):
    with pytest.raises(ValueError, match=message):
        draftsman.load({"target": {"path": str(llama[0])}, **raw})


@pytest.mark.parametrize("device, message", [
    ("gpu", r"unknown device 'gpu': use auto \(cuda where there is one, else cpu\), cpu, cuda or cuda:N"),
    ("cuda", r"device 'cuda' asked for, but this torch .* sees no CUDA GPU .*: use device auto"),
    ("cuda:7", "device 'cuda:7' asked for, but this"),
])
def test_a_device_this_machine_lacks_is_named_at_load(llama, device, message):
    """It failed as torch's "AssertionError: Torch not compiled with CUDA enabled" from the model's .to()."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device == "cuda" and gpus) or (device == "cuda:7" and gpus > 7):
        pytest.skip("this machine has the GPU asked for")
    with pytest.raises(ValueError, match=message):
        draftsman.load({"target": {"path": str(llama[0]), "device": device}})


@pytest.mark.parametrize("raw, message", [
    ({"sampling": {"temperature": -1.0}}, r"sampling.temperature must be >= 0 \(0 = greedy\), got -1.0"),
    ({"sampling": {"top_p": 2.0}}, r"sampling.top_p must be in \(0, 1\]"),
    ({"sampling": {"repetition_penalty": float("nan")}}, "sampling.repetition_penalty must be a finite number"),
    ({"generation": {"max_new_tokens": 0}}, "generation.max_new_tokens must be >= 1, got 0"),
    ({"generation": {"min_new_tokens": 100}}, r"generation.min_new_tokens must be in \[0, max_new_tokens = 64\]"),
])
def test_out_of_range_config_values_are_named_at_load(llama, raw, message):
    """They were accepted, then refused at each call that used them: under `draftsman serve`, every
    request, as if the request were wrong."""
    with pytest.raises(ValueError, match=message):
        draftsman.load({"target": {"path": str(llama[0])}, **raw})


def test_a_config_that_is_not_a_mapping_says_so(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- target\n- drafter\n")
    with pytest.raises(ValueError, match="must be a mapping of sections"):
        draftsman.load(str(path))


@pytest.mark.parametrize("drafter, message", [
    ({"name": "ngram", "kk": 3}, r"unknown option\(s\) \['kk'\] for drafter 'ngram'; valid options: "
                                 r"\['adaptive', 'branches', 'k', 'max_ngram', 'min_ngram'\]"),
    ({"name": "none", "k": 3}, r"unknown option\(s\) \['k'\] for drafter 'none'; valid options: \['adaptive'\]"),
    ({"name": "draft_model", "path": "x", "depth": 3},
     r"\['depth'\] for drafter 'draft_model'.*'k', 'mask_token_id', 'min_confidence', 'parallel_drafting', 'path'"),
    ({"name": "draft_model"}, "set drafter.path"),
    ({"name": "draft_model", "path": "x", "quantize": "int4"}, r"draft_model: quantize must be one of \['int8', 'auto'\]"),
    ({"name": "draft_model", "path": "x", "quantize": "int8", "dtype": "bfloat16"}, "int8 products in float32"),
    ({"name": "ngram", "k": 0}, "k and branches must be >= 1"),
    ({"name": "no_such_drafter"}, r"unknown drafter 'no_such_drafter'; available drafters: \['cascade', "
                                  r"'cross_tokenizer', 'draft_model', 'eagle', 'gemma4_assistant', 'layer_skip', "
                                  r"'medusa', 'mlp_speculator', 'mtp', 'native_mtp', 'ngram', 'none', 'recycling', "
                                  r"'retrieval', "
                                  r"'suffix'\]"),
])
def test_bad_drafter_settings_name_the_problem(llama, drafter, message):
    with pytest.raises(ValueError, match=message):
        draftsman.load(config(llama[0], drafter=drafter))


# ----------------------------------------------------------------------------- model folders

def test_missing_target_folder_is_named(tmp_path):
    missing = tmp_path / "no-such-target"
    with pytest.raises(FileNotFoundError, match=f"target.path: model folder '{missing}' does not exist"):
        draftsman.load(config(missing))


def test_missing_target_path_says_it_is_required():
    with pytest.raises(ValueError, match="target.path is required"):
        draftsman.load({})


def test_a_model_file_given_as_its_folder_is_named(llama):
    """(a model.safetensors given as the folder was said not to exist)"""
    weights = llama[0] / "model.safetensors"
    with pytest.raises(FileNotFoundError, match=f"target.path: '{weights}' is a file, not a model folder: give the"):
        draftsman.load(config(weights))


def test_a_folder_without_config_json_is_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        draftsman.load(config(tmp_path))


def test_a_training_run_names_a_missing_target_folder(tmp_path, tiny_corpus):
    """Heads training reads its target without draftsman.load; the same error names the folder."""
    from draftsman.training.heads import train

    missing = tmp_path / "no-such-target"
    with pytest.raises(FileNotFoundError, match=f"target: model folder '{missing}' does not exist"):
        train({"kind": "medusa", "target": str(missing), "out": str(tmp_path / "out"), "threads": 1,
               "mixed_precision": "no", "corpus_root": str(tiny_corpus), "work_dir": str(tmp_path / "w")})


def test_missing_drafter_folder_is_named(llama, tmp_path):
    missing = tmp_path / "no-such-draft"
    with pytest.raises(FileNotFoundError, match=f"draft_model: drafter.path '{missing}' does not exist"):
        draftsman.load(config(llama[0], drafter={"name": "draft_model", "path": str(missing)}))


@pytest.mark.parametrize("kind, drafter", [("medusa", "medusa"), ("eagle3", "eagle"), ("mtp", "mtp")])
def test_a_heads_folder_given_as_a_draft_model_names_its_drafter(llama, fresh_heads, kind, drafter):
    """transformers' "Unrecognized model in ... Should have a `model_type` key" said nothing of heads."""
    with pytest.raises(ValueError, match=f"holds {kind} heads .* not a causal LM: use drafter: {drafter} with path"):
        draftsman.load(config(llama[0], drafter={"name": "draft_model", "path": str(fresh_heads / kind)}))
    # (mlp_speculator said the folder "holds a None model")
    with pytest.raises(ValueError, match=f"holds {kind} heads .* not an MLP speculator: use drafter: {drafter} with"):
        draftsman.load(config(llama[0], drafter={"name": "mlp_speculator", "path": str(fresh_heads / kind)}))


@pytest.mark.parametrize("drafter, message", [
    ({"name": "ngarm"}, "unknown drafter 'ngarm'"),
    ({"name": "ngram", "kk": 3}, r"unknown option\(s\) \['kk'\]"),
    ({"name": "ngram", "k": "4"}, "option k must be int"),
    ({"name": "ngram", "adaptive": "yes"}, "adaptive must be true or false"),
    # Accepted, these failed mid-run with a traceback: int(inf) in suffix's depth, a bare int iterated.
    ({"name": "suffix", "max_spec_offset": float("inf")}, "option max_spec_offset must be a finite number, got inf"),
    ({"name": "suffix", "max_spec_factor": float("nan")}, "option max_spec_factor must be a finite number, got nan"),
    ({"name": "layer_skip", "skip_layers": 4}, r"option skip_layers must be list\[int\] or null, got 4"),
    ({"name": "layer_skip", "skip_layers": [1, "4"]}, r"option skip_layers\[1\] must be int, got '4'"),
    ({"name": "layer_skip", "skip_layers": [True]}, r"option skip_layers\[0\] must be int, got True"),
    # A rank of "x" failed mid-run ("bad operand type for unary -"); a tree took over the others silently.
    ({"name": "recycling", "rank_accuracy": [[0.6, "x"]]}, r"option rank_accuracy\[0\]\[1\] must be float or null"),
    ({"name": "recycling", "rank_accuracy": [[0.6, 1.5]]}, r"list per rank of shares in \[0, 1\]"),
    ({"name": "recycling", "tree": []}, r"recycling: tree \[\] has no paths"),
    ({"name": "recycling", "tree": [[0]], "tree_budget": 64}, "tree gives the paths itself; tree_budget and"),
    ({"name": "medusa", "path": "x", "tree": [[0]], "tree_budget": 8}, "tree gives the paths itself and tree_budget"),
    ({"name": "medusa", "path": "x", "tree": [["0"]]}, r"option tree\[0\]\[0\] must be int, got '0'"),
    ({"name": "eagle"}, "set drafter.path"),
    ({"name": "medusa", "path": "MISSING"}, "medusa: drafter.path '.*no-such-heads' does not exist"),
    ({"name": "cascade", "drafters": [{"name": "ngram"}, {"name": "mtp", "path": "MISSING"}]},
     "mtp: drafter.path '.*no-such-heads' does not exist"),
])
def test_a_drafter_mistake_is_named_before_the_target_loads(llama, tmp_path, monkeypatch, drafter, message):
    """A large target takes minutes (and the GPU's memory) to load; a misspelt drafter, option or folder
    must not wait for it."""
    def load_causal_lm(*args, **kwargs):
        raise AssertionError("the target was loaded before the drafter's config was checked")

    monkeypatch.setattr(draftsman.api, "load_causal_lm", load_causal_lm)
    missing = str(tmp_path / "no-such-heads")
    drafter = {k: missing if v == "MISSING" else v for k, v in drafter.items()}
    for child in drafter.get("drafters", []):
        child.update({k: missing for k, v in child.items() if v == "MISSING"})
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        draftsman.load(config(llama[0], drafter=drafter))


@pytest.mark.parametrize("drafter", ["retrieval", "cross_tokenizer", "draft_model"])
def test_a_home_relative_drafter_path_is_expanded_for_every_drafter(monkeypatch, tmp_path, drafter):
    """The option check expanded "~" to find the path, but retrieval and cross_tokenizer then
    opened it as given ("'~/corpus.txt' does not exist")."""
    from draftsman.drafters import registry

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "given").write_text("x = 1\n")
    options = registry.drafter_options(registry._REGISTRY[drafter], {"path": "~/given"})
    assert options.path == str(tmp_path / "given")


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file .*absent.yaml' does not exist"):
        draftsman.load(str(tmp_path / "absent.yaml"))


# ----------------------------------------------------------------------------- vocabularies

@pytest.fixture(scope="module")
def foreign_drafts(tmp_path_factory):
    """Draft models whose tokenizers differ from the tiny target's: a smaller vocabulary, and one of
    the same size whose tokens map to other ids (trained on other text)."""
    root = tmp_path_factory.mktemp("foreign")
    smaller = build_tokenizer(root / "tok-small", vocab_size=300)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "CORPUS", [line[::-1] for line in tiny_models.CORPUS])
        remapped = build_tokenizer(root / "tok-remapped")
    return {"smaller": build_model_folder(root / "small", "llama", seed=1, size="draft", tokenizer=smaller),
            "remapped": build_model_folder(root / "remapped", "llama", seed=2, size="draft", tokenizer=remapped)}


@pytest.mark.parametrize("which, detail", [
    ("smaller", "the drafter's output layer has 300 tokens, the target's 320"),
    ("remapped", "token '.+' has id \\d+ in the target but (id \\d+|no id) in the drafter"),
])
def test_a_draft_model_with_another_vocabulary_is_refused(llama, foreign_drafts, which, detail, tiny_tokenizer):
    if which == "remapped":
        assert len(tiny_tokenizer) == 320  # same size: only the token map differs
    with pytest.raises(ValueError, match=f"cannot draft for target .*: {detail}.*same vocabulary"):
        draftsman.load(config(llama[0], drafter={"name": "draft_model", "path": str(foreign_drafts[which])}))
