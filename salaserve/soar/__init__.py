"""The SOAR platform's way in: a submission folder that installs salaserve (`package.py`), and the
shim that makes the platform's `python -m sglang.launch_server ...` start salaserve (`shim.py`,
`sglang_redirect.py`, `launch_server.py`)."""
