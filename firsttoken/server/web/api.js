// The server's HTTP API as the page uses it: models, pins and streamed chat completions.

// An error reply, with the server's own message (it names the field at fault) and status.
export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

export class Api {
  // `apiKey` returns the key to send, or "" for a server without one.
  constructor(apiKey) {
    this.apiKey = apiKey;
  }

  async models() {
    const body = await this.request("GET", "/v1/models");
    return body.data.map((card) => card.id);
  }

  pin(systemPrompt) {
    return this.request("POST", "/v1/pins", { system_prompt: systemPrompt });
  }

  unpin(pinId) {
    return this.request("DELETE", `/v1/pins/${encodeURIComponent(pinId)}`);
  }

  // The response of a streamed chat completion, its body not yet read.
  async streamChat(body, signal) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: this.headers(true),
      body: JSON.stringify(body),
      signal,
    });
    if (!response.ok) throw await errorOf(response);
    return response;
  }

  async request(method, path, body) {
    const response = await fetch(path, {
      method,
      headers: this.headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }

  headers(hasBody) {
    const headers = {};
    if (hasBody) headers["Content-Type"] = "application/json";
    const key = this.apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // Not the JSON error shape (a proxy's page): the status line says enough.
  }
  return new ApiError(message, response.status);
}
