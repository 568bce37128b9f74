"""Prompt data: dataset readers (JSONL / Parquet), tokenizers (HF tokenizer.json + chat template, and a
built-in character tokenizer), built-in synthetic tasks, and the grain batching pipeline."""

from jaxrl_fp8.data.builtin_tokenizer import builtin_tokenizer
from jaxrl_fp8.data.chat_template import ChatTemplateError, render_chat_template
from jaxrl_fp8.data.pipeline import LoaderConfig, PromptBatch, PromptLoader, pad_prompts
from jaxrl_fp8.data.readers import DatasetFields, ReadReport, read_prompt_dataset
from jaxrl_fp8.data.records import DatasetError, PromptRecord
from jaxrl_fp8.data.synthetic import (
    TASK_NAMES,
    SyntheticTask,
    make_task,
    random_policy_expected_reward,
    random_policy_reward_mc,
    synthetic_splits,
)
from jaxrl_fp8.data.tokenizer import TextTokenizer, load_tokenizer
