// test_openai.mjs — the official OpenAI Node client against `strata serve`.
//
// Usage: node test_openai.mjs PORT. The package comes from build/npm beside
// this file (`.ci/run` installs it there; STRATA_NPM overrides the folder).
// Owns: driving a running server through the client's own API (chat, streamed
// chat with usage, completions, models, log-probabilities, an error) and
// checking the shapes the client hands back. It prints one line of JSON with
// the greedy texts it got, which test_http.c compares with the server's
// answers to the same requests made directly; it starts no server itself.
// Exit status: 0 all checks held, 1 a check failed, 77 the package is absent.
import { createRequire } from 'node:module';
import { existsSync } from 'node:fs';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const npmDir = resolve(process.env.STRATA_NPM || join(dirname(fileURLToPath(import.meta.url)), 'build', 'npm'));
if (!existsSync(join(npmDir, 'node_modules', 'openai', 'package.json'))) {
    console.log(`skip: no openai package under ${npmDir}`);
    process.exit(77);
}
const require = createRequire(join(npmDir, 'package.json'));
const { OpenAI, APIError, BadRequestError } = require('openai');

const port = Number(process.argv[2]);
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60000 });

function check(cond, what) {
    if (!cond)
        throw new Error(`check failed: ${what}`);
}

// the requests test_http.c repeats directly (keep the two in step)
const chatReq = { model: 'm', messages: [{ role: 'user', content: 'Hello' }], max_tokens: 12, temperature: 0 };
const cmplReq = { model: 'm', prompt: 'It was a cold morning in November, and', max_tokens: 12, temperature: 0 };

async function main() {
    const out = {};

    const models = await client.models.list();
    check(models.data.length === 1 && models.data[0].object === 'model', 'one model in /v1/models');
    out.model = models.data[0].id;

    const chat = await client.chat.completions.create(chatReq);
    const c0 = chat.choices[0];
    check(chat.object === 'chat.completion' && chat.id.startsWith('chatcmpl-'), 'chat object and id');
    check(c0.message.role === 'assistant' && typeof c0.message.content === 'string', 'assistant message');
    check(c0.finish_reason === 'stop' || c0.finish_reason === 'length', `finish_reason ${c0.finish_reason}`);
    const u = chat.usage;
    check(u.prompt_tokens > 0 && u.completion_tokens > 0 && u.completion_tokens <= 12 &&
          u.total_tokens === u.prompt_tokens + u.completion_tokens, 'chat usage');
    out.chat = c0.message.content;
    out.chat_finish = c0.finish_reason;

    const stream = await client.chat.completions.create({ ...chatReq, stream: true,
                                                          stream_options: { include_usage: true } });
    let text = '', finish = null, usage = null, chunks = 0, role = null;
    for await (const ch of stream) {
        chunks++;
        check(ch.object === 'chat.completion.chunk', 'chunk object');
        if (ch.usage)
            usage = ch.usage;
        if (!ch.choices.length)
            continue;
        const d = ch.choices[0].delta;
        if (d.role)
            role = d.role;
        if (d.content)
            text += d.content;
        if (ch.choices[0].finish_reason)
            finish = ch.choices[0].finish_reason;
    }
    check(role === 'assistant', 'the stream names the role');
    check(chunks >= 3, `${chunks} chunks`);
    check(text === out.chat, `streamed text ${JSON.stringify(text)} equals the non-streamed one`);
    check(finish === out.chat_finish, `stream finish_reason ${finish}`);
    check(usage && usage.completion_tokens === u.completion_tokens && usage.prompt_tokens === u.prompt_tokens,
          'stream usage (stream_options.include_usage)');

    const cmpl = await client.completions.create(cmplReq);
    check(cmpl.object === 'text_completion' && cmpl.choices.length === 1, 'completion object');
    check(cmpl.choices[0].finish_reason === 'length' && cmpl.usage.completion_tokens === 12, 'completion length');
    out.completion = cmpl.choices[0].text;

    const lp = await client.chat.completions.create({ ...chatReq, logprobs: true, top_logprobs: 3 });
    const content = lp.choices[0].logprobs && lp.choices[0].logprobs.content;
    check(lp.choices[0].message.content === out.chat, 'logprobs leave the text unchanged');
    check(Array.isArray(content) && content.length === lp.usage.completion_tokens, 'one logprobs entry per token');
    for (const e of content) {
        check(typeof e.token === 'string' && e.logprob <= 0 && e.top_logprobs.length === 3, 'logprobs entry shape');
        // greedy: the chosen token is the most probable one
        check(e.top_logprobs[0].token === e.token && Math.abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6,
              `greedy token ${JSON.stringify(e.token)} heads its top_logprobs`);
        for (let k = 1; k < 3; k++)
            check(e.top_logprobs[k].logprob <= e.top_logprobs[k - 1].logprob, 'top_logprobs in order');
    }
    out.logprobs = content.map((e) => e.logprob);

    let status = 0;
    try {
        await client.chat.completions.create({ ...chatReq, n: 2 });
    } catch (err) {
        check(err instanceof APIError && err instanceof BadRequestError, `n=2 raises a BadRequestError (${err})`);
        status = err.status;
        check(err.error && typeof err.error.message === 'string', 'the error body has a message');
    }
    check(status === 400, `n=2 answered ${status}, not 400`);

    console.log(JSON.stringify(out));
}

main().catch((err) => {
    console.error(String(err && err.stack ? err.stack : err));
    process.exit(1);
});
