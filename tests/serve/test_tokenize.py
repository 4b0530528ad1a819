"""``/tokenize`` and ``/detokenize`` in process: the ingress's ``Preprocessor`` on the shipped tiny model's tokenizer
(no engine), against what the same prompts become on the generation path. The app's endpoints against vLLM's own
server: ``test_vllm_app.py``."""

import asyncio

import pytest
from transformers import AutoTokenizer

from kairos_ray.serve.args import AppArgs
from kairos_ray.serve.protocol import RequestError
from kairos_ray.serve.tokens import Preprocessor
from tests.serve.conftest import CPU_CONTEXT, CPU_MODEL, cpu_args

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    """As the vLLM CPU app's ingress makes it."""
    pool = AppArgs.model_validate(cpu_args()).decode_config
    return Preprocessor(CPU_MODEL, CPU_CONTEXT, pool.model_loading_config.source, pool.vllm_engine_kwargs())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(AppArgs.model_validate(cpu_args()).decode_config.model_loading_config.source)


def test_a_prompts_token_ids_are_the_tokenizers(preprocessor, tokenizer):
    body = {"model": CPU_MODEL, "prompt": "the quick brown fox", "return_token_strs": True}
    answer = asyncio.run(preprocessor.tokenize(body))
    ids = tokenizer("the quick brown fox")["input_ids"]
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert answer["max_model_len"] == CPU_CONTEXT
    bare = asyncio.run(preprocessor.tokenize({"prompt": "the quick brown fox", "add_special_tokens": False}))
    assert bare["tokens"] == tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_chats_token_ids_are_what_the_generation_path_routes(preprocessor, add_generation_prompt):
    """The chat template renders the same ids for ``/tokenize`` as for a chat completion (the prompt the router
    prices and the engines prefill)."""
    options = {"add_generation_prompt": add_generation_prompt}
    answer = asyncio.run(preprocessor.tokenize({"messages": MESSAGES, **options}))
    chat = {"messages": MESSAGES, "max_completion_tokens": 4, **options}
    (prepared,) = asyncio.run(preprocessor.prepare(chat, chat=True))
    assert answer["tokens"] == list(prepared.prompt_token_ids) and answer["count"] == prepared.prompt_tokens
    other = asyncio.run(
        preprocessor.tokenize({"messages": MESSAGES, "add_generation_prompt": not add_generation_prompt})
    )
    assert other["tokens"] != answer["tokens"]


def test_detokenize_gives_back_the_text(preprocessor, tokenizer):
    ids = tokenizer("seven wise owls count stars", add_special_tokens=False)["input_ids"]
    answer = asyncio.run(preprocessor.detokenize({"model": CPU_MODEL, "tokens": ids}))
    assert answer == {"prompt": "seven wise owls count stars"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": 5}, 400, "prompt"),
        ({"tokens": "abc"}, 400, "tokens"),
        ({"messages": "hello"}, 400, "messages"),
        ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, 400, None),
        ({"prompt": "a", "model": "other"}, 404, "model"),
        (["prompt"], 400, None),
    ],
)
def test_a_bad_body_is_a_client_error_naming_the_field(preprocessor, body, status, param):
    call = preprocessor.detokenize if "tokens" in body else preprocessor.tokenize
    with pytest.raises(RequestError) as refused:
        asyncio.run(call(body))
    assert refused.value.status == status
    assert param is None or refused.value.param == param or param in refused.value.message


def test_emulated_engines_answer_that_they_have_no_tokenizer():
    emulated = Preprocessor(CPU_MODEL, CPU_CONTEXT)
    for call in (emulated.tokenize, emulated.detokenize):
        with pytest.raises(RequestError) as refused:
            asyncio.run(call({"prompt": "a", "tokens": [1]}))
        assert refused.value.status == 501 and "emulated" in refused.value.message
