"""What the tests share: bitwise and kernel checks (`bitwise`, `kernel_checks`, `paired`), trainer configs (`trainer`),
real vLLM servers (`server`) and subprocess environments (`env`). The tests folder is on `sys.path` (pytest puts the
root conftest's folder there; `env.subprocess_env` puts it on a child's PYTHONPATH), so `from helpers.x import y`."""
