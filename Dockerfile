# The kb-pipeline image: one image, every service is a `kb` sub-command.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 UV_PYTHON_DOWNLOADS=never
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
COPY services ./services
# The development tools too, as in the wheel: every command `kb --help` lists runs.
COPY kbtools ./kbtools
COPY migrations ./migrations
COPY schemas ./schemas
# Bytecode compiled at build: the image runs with PYTHONDONTWRITEBYTECODE, so without it
# every process would compile what it imports, a second or more before its first claim.
RUN uv sync --frozen --no-dev --compile-bytecode \
    && .venv/bin/python -m compileall -q services kbtools \
    && useradd --system kb
ENV PATH=/app/.venv/bin:$PATH
USER kb
ENTRYPOINT ["kb"]
