#!/usr/bin/env node
// Drives mirage-server's chat page in headless Chromium (playwright-core,
// Debian's /usr/bin/chromium): types a question, waits for the streamed
// answer, checks it, and saves a screenshot.
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
    await page.screenshot({ path: shot, fullPage: false });
  } finally {
    await browser.close();
  }
  console.log(`chat page: ${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => { console.error(e); console.log("chat page: 0 passed, 1 failed"); process.exit(1); });
