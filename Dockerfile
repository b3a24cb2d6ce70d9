# The kb-pipeline image: one image, every service is a `kb` sub-command.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 UV_PYTHON_DOWNLOADS=never
RUN pip install --no-cache-dir uv==0.13.9
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
COPY services ./services
COPY migrations ./migrations
COPY schemas ./schemas
RUN uv sync --frozen --no-dev && useradd --system kb
ENV PATH=/app/.venv/bin:$PATH
USER kb
ENTRYPOINT ["kb"]
