// test_chat_page.mjs — the chat page at `/` of `strata serve`, in headless Chromium.
//
// Usage: node test_chat_page.mjs PORT MESSAGE. puppeteer-core comes from
// build/npm beside this file (`.ci/run` installs it there; STRATA_NPM
// overrides the folder); the browser is Debian's /usr/bin/chromium (CHROMIUM
// overrides it). Owns: typing MESSAGE into the page as a person would,
// sending it with Enter, waiting for the streamed reply to finish, and
// printing one line of JSON: the rendered reply, how many times the reply
// changed while it streamed, and the tokens/s line. test_http.c compares the
// reply with the server's answer to the same request; this starts no server.
// Exit status: 0 the page worked, 1 it did not, 77 puppeteer-core or the
// browser is absent.
import { createRequire } from 'node:module';
import { existsSync } from 'node:fs';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const npmDir = resolve(process.env.STRATA_NPM || join(dirname(fileURLToPath(import.meta.url)), 'build', 'npm'));
const chromium = process.env.CHROMIUM || '/usr/bin/chromium';
if (!existsSync(join(npmDir, 'node_modules', 'puppeteer-core', 'package.json')) || !existsSync(chromium)) {
    console.log(`skip: no puppeteer-core under ${npmDir} or no ${chromium}`);
    process.exit(77);
}
const require = createRequire(join(npmDir, 'package.json'));
const puppeteer = require('puppeteer-core');

const port = Number(process.argv[2]);
const message = process.argv[3];

async function main() {
    const browser = await puppeteer.launch({
        executablePath: chromium,
        headless: true,
        // root in CI has no user namespaces for the sandbox; /dev/shm may be small
        args: ['--no-sandbox', '--disable-dev-shm-usage', '--disable-gpu'],
        timeout: 60000,
    });
    try {
        const page = await browser.newPage();
        const pageErrors = [];
        page.on('pageerror', (e) => pageErrors.push(String(e)));
        await page.goto(`http://127.0.0.1:${port}/`, { waitUntil: 'load', timeout: 30000 });
        if ((await page.title()) !== 'Strata chat')
            throw new Error(`page title ${await page.title()}`);
        // count the reply's renderings: a streamed reply is drawn more than once
        await page.evaluate(() => {
            window.replyUpdates = 0;
            new MutationObserver(() => {
                const a = document.querySelector('.msg.assistant');
                if (a && a.textContent)
                    window.replyUpdates++;
            }).observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true });
        });
        await page.type('#in', message);
        await page.keyboard.press('Enter');
        await page.waitForSelector('.msg.user', { timeout: 10000 });
        // the button is disabled while the reply streams and enabled at its end
        await page.waitForFunction(() => document.querySelector('.msg.assistant') &&
                                         !document.getElementById('send').disabled, { timeout: 120000 });
        const got = await page.evaluate(() => ({
            user: document.querySelector('.msg.user').textContent,
            reply: document.querySelector('.msg.assistant').textContent,
            updates: window.replyUpdates,
            stats: document.getElementById('stats').textContent,
        }));
        if (got.user !== message)
            throw new Error(`the page shows the message as ${JSON.stringify(got.user)}`);
        if (pageErrors.length)
            throw new Error(`page errors: ${pageErrors.join('; ')}`);
        if (!/tokens\/s/.test(got.stats))
            throw new Error(`no tokens/s line: ${JSON.stringify(got.stats)}`);
        console.log(JSON.stringify({ reply: got.reply, updates: got.updates, stats: got.stats }));
    } finally {
        await browser.close();
    }
}

main().catch((err) => {
    console.error(String(err && err.stack ? err.stack : err));
    process.exit(1);
});
