"""The local appliance's tiny model directory: config.json, a tokenizer and a chat template.

The model is a 2-layer Llama with random weights (vLLM's `--load-format dummy`). Its tokenizer
is built here, with no download: a byte-level BPE trained by the `tokenizers` library (which
vLLM installs) on a corpus generated deterministically below, so every run on every machine
writes the same bytes. Its vocabulary is exactly the model's `vocab_size`, so every id the
random model can generate decodes; ids 0 and 1 are `<s>` and `</s>` (the model's bos and
eos), then one token per chat role. The chat template renders

    <s><|system|>\\nYou are terse.</s><|user|>\\nHello</s><|assistant|>\\n

(`add_generation_prompt` adds the last `<|assistant|>\\n`); the model's turn ends with `</s>`.
With `tools` it also lists them and asks for `<tool_call>` JSON, what vLLM's `hermes`
tool-call parser reads (CHAT_TEMPLATE, TOOL_CALL_PARSER).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from dspark.files import state_io

# A 2-layer Llama with random weights: enough to run the real engine, the real TP=2
# collectives and the real HTTP API, small enough to start on two CPU cores. 4 attention
# and 4 KV heads: tensor parallel 2 and 4 both divide them.
TINY_MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

BOS = "<s>"
EOS = "</s>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# In id order: bos 0, eos 1 (TINY_MODEL's bos_token_id / eos_token_id), then the roles 2, 3, 4.
SPECIAL_TOKENS = (BOS, EOS, *ROLE_TOKENS.values())

# Each turn: its role token, a newline, the text, then eos. With `tools`, a first system turn
# lists them (one JSON object a line within <tools></tools>, after the system prompt if there is
# one) and says how to call one: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the
# form vLLM's `hermes` tool-call parser reads (TOOL_CALL_PARSER). An assistant turn's tool
# calls are written that way; a tool's answer is a user turn within <tool_response> tags (no
# role token of its own: the tokenizer stays as it is). Other roles (developer, ...) are
# refused with vLLM's HTTP 400 rather than rendered as something the model was never shown.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- (messages[0]['content'] or '') + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You may call functions. Their signatures, one JSON object a line, "
    "are within <tools></tools>:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nTo call one, answer with its name and arguments as a JSON object within <tool_call></tool_call> "
    "tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call>' + eos_token -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('dspark-local chat roles are system, user, assistant and tool, not ' + role) -}}"
    "{%- elif role == 'tool' -%}"
    "{{- '<|user|>\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' + eos_token -}}"
    "{%- elif not (tools and loop.first and role == 'system') -%}"
    "{{- '<|' + role + '|>\\n' + (message['content'] or '') -}}"
    "{%- if role == 'assistant' and message.tool_calls is defined and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{{- (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
# vLLM's tool-call parser that reads what CHAT_TEMPLATE asks for (vllm/tool_parsers/
# hermes_tool_parser.py: JSON within <tool_call></tool_call>). The GB10 pair uses deepseek_v4.
TOOL_CALL_PARSER = "hermes"

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

# --- the training corpus: generated, the same on every machine --------------------------------

_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new "
    "work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help low "
    "line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here "
    "must big high such follow act why ask men change went light kind off need house picture try "
    "us again animal point mother world near build self earth father head stand own page should "
    "country found answer school grow study still learn plant cover food sun four between state "
    "keep eye never last let thought city tree cross farm hard start might story saw far sea draw "
    "left late run while press close night real life few north open seem together next white "
    "children begin got walk example ease paper group always music those both mark often letter "
    "until mile river car feet care second book carry took science eat room friend began idea "
    "fish mountain stop once base hear horse cut sure watch color face wood main enough plain "
    "girl usual young ready above ever red list though feel talk bird soon body dog family direct "
    "pose leave song measure door product black short numeral class wind question happen complete "
    "ship area half rock order fire south problem piece told knew pass since top whole king space "
    "heard best hour better true during hundred five remember step early hold west ground interest "
    "reach fast verb sing listen six table travel less morning ten simple several vowel toward war "
    "lay against pattern slow center love person money serve appear road map rain rule govern pull "
    "cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan "
    "figure star box noun field rest correct able pound done beauty drive stood contain front "
    "teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force blue "
    "object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought "
    "heat snow tire bring yes distant fill east paint language among grand ball yet wave drop "
    "heart present heavy dance engine position arm wide sail material size vary settle speak "
    "weight general ice matter circle pair include divide syllable felt perhaps pick sudden count "
    "square reason length represent art subject region energy hunt probable bed brother egg ride "
    "cell believe fraction forest sit race window store summer train sleep prove lone leg exercise "
    "wall catch mount wish sky board joy winter sat written wild instrument kept glass grass cow "
    "job edge sign visit past soft fun bright gas weather month million bear finish happy hope "
    "flower clothe strange gone jump baby eight village meet root buy raise solve metal whether "
    "push seven paragraph third shall held hair describe cook floor either result burn hill safe "
    "cat century consider type law bit coast copy phrase silent tall sand soil roll temperature "
    "finger industry value fight lie beat excite natural view sense ear else quite broke case "
    "middle kill son lake moment scale loud spring observe child straight consonant nation "
    "dictionary milk speed method organ pay age section dress cloud surprise quiet stone tiny "
    "climb cool design poor lot experiment bottom key iron single stick flat twenty skin smile "
    "crease hole trade melody trip office receive row mouth exact symbol die least trouble shout "
    "except wrote seed tone join suggest clean break lady yard rise bad blow oil blood touch grew "
    "cent mix team wire cost lost brown wear garden equal sent choose fell fit flow fair bank "
    "collect save control decimal gentle woman captain practice separate difficult doctor please "
    "protect noon whose locate ring character insect caught period indicate radio spoke atom "
    "human history effect electric expect crop modern element hit student corner party supply "
    "bone rail imagine provide agree thus capital chair danger fruit rich thick soldier process "
    "operate guess necessary sharp wing create neighbor wash bat rather crowd corn compare poem "
    "string bell depend meat rub tube famous dollar stream fear sight thin triangle planet hurry "
    "chief colony clock mine tie enter major fresh search send yellow gun allow print dead spot "
    "desert suit current lift rose continue block chart hat sell success company subtract event "
    "particular deal swim term opposite wife shoe shoulder spread arrange camp invent cotton born "
    "determine quart nine truck noise level chance gather shop stretch throw shine property column "
    "molecule select wrong gray repeat require broad prepare salt nose plural anger claim continent "
    "oxygen sugar death pretty skill women season solution magnet silver thank branch match suffix "
    "especially fig afraid huge sister steel discuss forward similar guide experience score apple "
    "bought led pitch coat mass card band rope slip win dream evening condition feed tool total "
    "basic smell valley nor double seat arrive master track parent shore division sheet substance "
    "favor connect post spend chord fat glad original share station dad bread charge proper bar "
    "offer segment slave duck instant market degree populate chick dear enemy reply drink occur "
    "support speech nature range steam motion path liquid log meant quotient teeth shell neck"
).split()
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "ch", "sh", "th", "st", "tr", "pl", "gr", "br", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ou", "ee", "oo", "io")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x")
_PUNCT = (".", ".", ".", ",", ",", "?", "!", ":", ";")


class _Lcg:
    """A fixed 32-bit linear congruential generator: the same numbers in every Python version
    (the corpus must not depend on how `random` is implemented)."""

    def __init__(self, seed: int) -> None:
        self.x = seed & 0xFFFFFFFF

    def below(self, n: int) -> int:
        self.x = (1664525 * self.x + 1013904223) & 0xFFFFFFFF
        return (self.x >> 8) % n


def corpus(lines: int = 3000) -> list[str]:
    """English words (more often the earlier, commoner ones), made-up words of 1-3 syllables,
    numbers and punctuation, in sentences: the same list on every machine."""
    rng = _Lcg(14)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(4 + rng.below(10)):
            kind = rng.below(10)
            if kind < 5:
                w = _WORDS[rng.below(rng.below(len(_WORDS)) + 1)]
            elif kind < 9:
                w = "".join(_ONSETS[rng.below(len(_ONSETS))] + _VOWELS[rng.below(len(_VOWELS))]
                            + _CODAS[rng.below(len(_CODAS))] for _ in range(1 + rng.below(3)))
            else:
                w = str(rng.below(10 ** (1 + rng.below(4))))
            words.append(w)
        words[0] = words[0][:1].upper() + words[0][1:]
        out.append(" ".join(words) + _PUNCT[rng.below(len(_PUNCT))])
    return out


# --- the files --------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """tokenizer.json's text: byte-level BPE with exactly TINY_MODEL's vocab_size ids. Needs the
    `tokenizers` library (installed with vLLM), imported only here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    vocab_size = TINY_MODEL["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    # A text prompt starts with bos, as the model's config says; chat prompts already carry it
    # (the template writes it and vLLM renders them without adding special tokens).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    got = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if tok.get_vocab_size() != vocab_size or got != {t: i for i, t in enumerate(SPECIAL_TOKENS)}:
        raise RuntimeError(f"tiny tokenizer: {tok.get_vocab_size()} ids (want {vocab_size}), special ids {got}")
    return tok.to_str(pretty=True) + "\n"


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "model_max_length": TINY_MODEL["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict:
    return {"bos_token_id": TINY_MODEL["bos_token_id"], "eos_token_id": TINY_MODEL["eos_token_id"]}


def _dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


def contents() -> dict[str, str]:
    """Every file of the model directory, name -> text (FILES)."""
    return {"config.json": _dumps(TINY_MODEL), "generation_config.json": _dumps(generation_config()),
            "tokenizer.json": tokenizer_json(), "tokenizer_config.json": _dumps(tokenizer_config())}


def write(model_dir: Path) -> None:
    """Write the tiny model's directory (FILES; made if missing). A file that already holds
    the same bytes is left untouched; one that differs is replaced atomically."""
    write_files(Path(model_dir), {name: text.encode() for name, text in contents().items()})


def write_files(model_dir: Path, files: dict[str, bytes]) -> None:
    """Write `files` (name -> bytes) into `model_dir` (made if missing), as write() says."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = model_dir / name
        try:
            if path.read_bytes() == data:
                continue
        except OSError:
            pass
        state_io.write_atomic(path, data, mode=None)
