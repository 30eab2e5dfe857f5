// A message's text as DOM: fenced code blocks as <pre><code>, `inline code` as <code>, the rest
// as plain text. Every piece of the text goes in through textContent or a text node, never as
// markup, so whatever a model writes (<script>, <img onerror=...>) is shown, not run.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
// A run of backticks, then text on the same line, then a run as long (``a ` b`` holds a backtick).
const INLINE_CODE = /(`+)([^`\n]|[^\n]*?[^`\n])\1(?!`)/g;

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
  const trimmed = text.replace(/^\n+|\n+$/g, "");
  let shown = 0;
  for (const match of trimmed.matchAll(INLINE_CODE)) {
    if (match.index > shown) paragraph.append(document.createTextNode(trimmed.slice(shown, match.index)));
    const code = document.createElement("code");
    code.textContent = match[2];
    paragraph.append(code);
    shown = match.index + match[0].length;
  }
  if (shown < trimmed.length) paragraph.append(document.createTextNode(trimmed.slice(shown)));
  return paragraph;
}
