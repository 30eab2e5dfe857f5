// Server-sent events read from a fetch() body: the JSON of each `data:` field, until [DONE].

const EVENT_END = /\r?\n\r?\n/;

// Yields, per network read, the list of events it completed: a reader can then update the
// page once per read, not once per token. Ends at [DONE] or when the body ends.
export async function* sseBatches(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      pending += value;
      const events = pending.split(EVENT_END);
      pending = events.pop();
      const batch = [];
      for (const event of events) {
        const data = eventData(event);
        if (data === "[DONE]") {
          if (batch.length) yield batch;
          return;
        }
        if (data !== null) batch.push(JSON.parse(data));
      }
      if (batch.length) yield batch;
    }
  } finally {
    // A reader that stops early (an error event) closes the connection: the server then ends
    // the request. Cancelling a finished or aborted body changes nothing, so its error is moot.
    reader.cancel().catch(() => {});
  }
}

// The event's data lines joined with newlines (the SSE rule), or null for an event without
// data, such as a comment kept to hold the connection open.
function eventData(event) {
  const lines = [];
  for (const line of event.split(/\r?\n/)) {
    if (line.startsWith("data:")) lines.push(line.slice(line.startsWith("data: ") ? 6 : 5));
  }
  return lines.length ? lines.join("\n") : null;
}
