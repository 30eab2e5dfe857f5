// A message's text as DOM: fenced code blocks as <pre><code>, `inline code` as <code>, the rest
// as plain text. Every piece of the text goes in through textContent or a text node, never as
// markup, so whatever a model writes (<script>, <img onerror=...>) is shown, not run.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const INLINE_CODE = /(`[^`\n]+`)/;

// A DocumentFragment holding `text` rendered; an unclosed fence (a reply still streaming)
// runs to the end of the text.
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  for (const block of splitBlocks(text)) {
    fragment.append(block.fence ? codeBlock(block.language, block.text) : prose(block.text));
  }
  return fragment;
}

// The text cut into prose and fenced-code blocks, in order.
function splitBlocks(text) {
  const blocks = [];
  let current = { fence: null, language: "", lines: [] };
  const finish = () => {
    const body = current.lines.join("\n");
    if (current.fence || body.trim()) blocks.push({ fence: current.fence, language: current.language, text: body });
  };
  for (const line of text.split("\n")) {
    const match = FENCE.exec(line);
    if (current.fence === null && match) {
      finish();
      current = { fence: match[1], language: match[2], lines: [] };
    } else if (current.fence !== null && isClosingFence(line, current.fence)) {
      finish();
      current = { fence: null, language: "", lines: [] };
    } else {
      current.lines.push(line);
    }
  }
  finish();
  return blocks;
}

function isClosingFence(line, fence) {
  const trimmed = line.trim();
  return trimmed.length >= fence.length && trimmed === fence[0].repeat(trimmed.length);
}

function codeBlock(language, text) {
  const figure = document.createElement("figure");
  figure.className = "code-block";
  if (language) {
    const caption = document.createElement("figcaption");
    caption.textContent = language;
    figure.append(caption);
  }
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  code.textContent = text;
  pre.append(code);
  figure.append(pre);
  return figure;
}

function prose(text) {
  const paragraph = document.createElement("p");
  paragraph.className = "prose";
  text.replace(/^\n+|\n+$/g, "").split(INLINE_CODE).forEach((part, index) => {
    // split() with a capturing group puts the matches at the odd indices.
    if (index % 2 === 1) {
      const code = document.createElement("code");
      code.textContent = part.slice(1, -1);
      paragraph.append(code);
    } else if (part) {
      paragraph.append(document.createTextNode(part));
    }
  });
  return paragraph;
}
