"""vLLM integration: hidden-state extraction through a vLLM engine and serving drafters with vLLM.

vLLM runs in its own virtual environment (``.venv-vllm``), always as a subprocess; only
``connector`` is imported by vLLM itself, and nothing else here imports vLLM.
"""
