#!/usr/bin/env node
// Drives mirage-server's chat page in headless Chromium (playwright-core,
// Debian's /usr/bin/chromium): types a question, waits for the streamed
// answer, checks it, and saves a screenshot. Then replays canned streams
// (the page's request answered by the test, not the model) to check that
// Markdown and code blocks render, that HTML in model output stays text,
// and that an API error is shown.
//
//   NODE_PATH=/tmp/mirage-node/node_modules node scripts/server_chat_page.js http://127.0.0.1:8080 out.png
//
// Prints `chat page: N passed, M failed` and exits non-zero on failure.
const { chromium } = require("playwright-core");

async function main() {
  const [base, shot] = process.argv.slice(2);
  if (!base || !shot) throw new Error("usage: server_chat_page.js BASE_URL SCREENSHOT.png");
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  let passed = 0, failed = 0;
  const check = (name, ok, detail) => {
    if (ok) { passed++; console.log(`ok   ${name}`); } else { failed++; console.log(`FAIL ${name}: ${detail}`); }
  };
  try {
    const page = await browser.newPage({ viewport: { width: 900, height: 640 } });
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(base + "/");
    await page.waitForFunction(() => document.getElementById("model").textContent.startsWith("model:"), null, { timeout: 10000 });
    check("model name shown", (await page.textContent("#model")).includes("smollm2"), await page.textContent("#model"));
    await page.fill("#temperature", "0");
    await page.fill("#max_tokens", "48");
    // Count how many times the reply grows while it streams.
    await page.evaluate(() => {
      window.__growth = 0;
      new MutationObserver(() => window.__growth++).observe(document.getElementById("log"),
        { subtree: true, childList: true, characterData: true });
    });
    await page.fill("#input", "What is the capital of France? Answer in one word.");
    await page.press("#input", "Enter");
    await page.waitForSelector(".msg.assistant.done", { timeout: 120000 });
    const reply = await page.textContent(".msg.assistant");
    check("reply mentions Paris", /Paris/.test(reply), JSON.stringify(reply));
    check("reply streamed in pieces", (await page.evaluate(() => window.__growth)) > 3, "too few DOM updates");
    check("usage line shown", /tokens, [0-9.]+ tok\/s/.test(await page.textContent(".msg.assistant .meta")), "no meta");
    check("no page errors", errors.length === 0, errors.join("; "));
    check("no error bubble", (await page.$(".msg.error")) === null, "error bubble present");

    // Canned replies: an SSE stream carrying `pieces` as content deltas.
    const sse = (pieces) => pieces.map((p) => "data: " + JSON.stringify({
      object: "chat.completion.chunk", choices: [{ index: 0, delta: { content: p }, finish_reason: null }],
    }) + "\n\n").join("") + "data: " + JSON.stringify({
      object: "chat.completion.chunk", choices: [{ index: 0, delta: {}, finish_reason: "stop" }],
      usage: { prompt_tokens: 5, completion_tokens: pieces.length, total_tokens: 5 + pieces.length },
    }) + "\n\ndata: [DONE]\n\n";
    let canned = null;
    await page.route("**/v1/chat/completions", (route) => route.fulfill(canned));
    const ask = async (q) => {
      const before = (await page.$$(".msg.assistant.done, .msg.error")).length;
      await page.fill("#input", q);
      await page.press("#input", "Enter");
      await page.waitForFunction((n) => document.querySelectorAll(".msg.assistant.done, .msg.error").length > n,
        before, { timeout: 20000 });
    };
    canned = { status: 200, contentType: "text/event-stream", body: sse([
      "Here is **bold** and a block:\n\n```py", "thon\nprint(\"<b>hi</b>\")\n", "```\n",
      "<img src=x onerror=\"window.__pwned=1\"><script>window.__pwned=2</script>",
      "[x](javascript:window.__pwned=3) <a href=\"#\" onclick=\"window.__pwned=4\">y</a>",
    ]) };
    await ask("markdown please");
    const last = (await page.$$(".msg.assistant .body")).pop();
    check("markdown bold rendered", (await last.$$("strong")).length === 1, await last.innerHTML());
    const code = await last.$("pre code.language-python");
    check("code block rendered", code !== null && (await code.textContent()) === 'print("<b>hi</b>")',
      await last.innerHTML());
    const injected = await last.$$("img, script, b, a[onclick], a[href^='javascript']");
    check("no HTML injected from model output", injected.length === 0, await last.innerHTML());
    check("injected text shown as text", (await last.textContent()).includes("<img src=x"), await last.textContent());
    check("no injected script ran", (await page.evaluate(() => window.__pwned)) === undefined, "window.__pwned set");

    canned = { status: 400, contentType: "application/json",
               body: JSON.stringify({ error: { message: "`max_tokens` must be at least 1.", type: "invalid_request_error",
                                               param: "max_tokens", code: "invalid_value" } }) };
    await ask("an error please");
    const err = await page.$(".msg.error");
    check("API error shown", err !== null && /400: `max_tokens` must be at least 1/.test(await err.textContent()),
      err && await err.textContent());
    check("no page errors after canned replies", errors.length === 0, errors.join("; "));
    await page.unroute("**/v1/chat/completions");
    await page.screenshot({ path: shot, fullPage: false });
  } finally {
    await browser.close();
  }
  console.log(`chat page: ${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => { console.error(e); console.log("chat page: 0 passed, 1 failed"); process.exit(1); });
