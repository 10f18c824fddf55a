// JavaScript clients against a real `kvblocks serve` (run by tests/test_compat_js.py).
//
// Usage: node compat.mjs BASE_URL API_KEY MODEL. Every check runs at the client's defaults and prints
// one JSON line {"check": name, "ok": bool, "detail": ...}; a check that throws is a failure with the
// error's message. Tool arguments and objects are bounded types (enums, booleans), so their shape does
// not depend on what the model would say.
import OpenAI from "openai";
import { zodResponseFormat, zodTextFormat } from "openai/helpers/zod";
import { generateObject, generateText, stepCountIs, streamObject, streamText, tool } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { z } from "zod";

const [base, apiKey, model] = process.argv.slice(2);
const Forecast = z.object({ city: z.enum(["Paris", "Rome"]), sunny: z.boolean() });
const City = z.object({ city: z.enum(["Paris", "Rome"]) });
const weatherTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city",
    parameters: { type: "object", properties: { city: { type: "string", enum: ["Paris", "Rome"] } },
      required: ["city"], additionalProperties: false },
  },
};
const timeTool = {
  type: "function",
  function: {
    name: "get_time",
    description: "The time in a city",
    parameters: { type: "object", properties: { city: { type: "string", enum: ["Paris", "Rome"] } },
      required: ["city"], additionalProperties: false },
  },
};
const ask = [{ role: "user", content: "What is the weather in Rome?" }];

function check(name, ok, detail) {
  console.log(JSON.stringify({ check: name, ok: Boolean(ok), detail }));
}

async function run(name, fn) {
  try {
    const [ok, detail] = await fn();
    check(name, ok, detail);
  } catch (e) {
    check(name, false, `${e.name}: ${e.message}`.slice(0, 2000));
  }
}

const validCity = (args) => {
  try {
    return City.safeParse(typeof args === "string" ? JSON.parse(args) : args).success;
  } catch {
    return false;
  }
};

// ---- the openai package ----------------------------------------------------------------------------
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey });

await run("openai.chat", async () => {
  const r = await client.chat.completions.create({ model, messages: ask, max_tokens: 8 });
  return [r.object === "chat.completion" && r.usage.prompt_tokens > 0 && r.system_fingerprint, r.choices[0]];
});

await run("openai.chat.stream", async () => {
  const stream = await client.chat.completions.create({
    model, messages: ask, max_tokens: 8, stream: true, stream_options: { include_usage: true },
  });
  let chunks = 0, usage = null, finish = null;
  for await (const chunk of stream) {
    chunks += 1;
    usage = chunk.usage ?? usage;
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  return [chunks > 1 && usage && finish, { chunks, usage, finish }];
});

await run("openai.chat.tools.required", async () => {
  const r = await client.chat.completions.create({
    model, messages: ask, tools: [weatherTool, timeTool], tool_choice: "required", max_tokens: 48,
  });
  const calls = r.choices[0].message.tool_calls ?? [];
  return [calls.length > 0 && calls.every((c) => validCity(c.function.arguments)), r.choices[0]];
});

await run("openai.chat.tools.stream", async () => {
  const stream = await client.chat.completions.create({
    model, messages: ask, tools: [weatherTool], tool_choice: "required", parallel_tool_calls: false,
    max_tokens: 64, stream: true,
  });
  let args = "", fragments = 0, finish = null;
  for await (const chunk of stream) {
    for (const call of chunk.choices[0]?.delta?.tool_calls ?? []) {
      if (call.function?.arguments) {
        args += call.function.arguments;
        fragments += 1;
      }
    }
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  return [validCity(args) && finish === "tool_calls", { args, fragments, finish }];
});

await run("openai.chat.parse.zod", async () => {
  const r = await client.chat.completions.parse({
    model, messages: ask, max_tokens: 48, response_format: zodResponseFormat(Forecast, "forecast"),
  });
  return [Forecast.safeParse(r.choices[0].message.parsed).success, r.choices[0].message];
});

await run("openai.responses.create", async () => {
  const r = await client.responses.create({ model, input: "Say hello", max_output_tokens: 8 });
  return [r.object === "response" && typeof r.output_text === "string" && r.usage.input_tokens > 0, r.usage];
});

await run("openai.responses.stream", async () => {
  const stream = client.responses.stream({ model, input: "Say hello", max_output_tokens: 8 });
  let deltas = 0;
  for await (const event of stream) if (event.type === "response.output_text.delta") deltas += 1;
  const final = await stream.finalResponse();
  return [deltas > 0 && final.status !== "failed", { deltas, status: final.status }];
});

await run("openai.responses.parse.zod", async () => {
  const r = await client.responses.parse({
    model, input: "The weather in Rome?", max_output_tokens: 48, text: { format: zodTextFormat(Forecast, "forecast") },
  });
  return [Forecast.safeParse(r.output_parsed).success, r.output_parsed];
});

await run("openai.responses.retrieve.input_items.delete", async () => {
  const r = await client.responses.create({ model, input: "Say hello", max_output_tokens: 4 });
  const again = await client.responses.retrieve(r.id);
  const items = await client.responses.inputItems.list(r.id);
  const deleted = await client.responses.delete(r.id);
  let gone = false;
  try {
    await client.responses.retrieve(r.id);
  } catch (e) {
    gone = e.status === 404;
  }
  return [again.id === r.id && items.data.length > 0 && gone, { items: items.data.length, deleted }];
});

// ---- the AI SDK: @ai-sdk/openai on the Responses and chat APIs, and @ai-sdk/openai-compatible --------
const openai = createOpenAI({ baseURL: `${base}/v1`, apiKey });
// openai-compatible sends a JSON schema only when told the server takes one (at its defaults it sends
// `json_object` and leaves the schema to the model, which a random model cannot follow).
const compatible = createOpenAICompatible({
  name: "kvblocks", baseURL: `${base}/v1`, apiKey, supportsStructuredOutputs: true,
});
const models = {
  "aisdk.responses": openai(model),
  "aisdk.chat": openai.chat(model),
  "aisdk.compatible": compatible(model),
};
const toolChoiceViolation = (e) => e.name === "AI_ToolChoiceViolationError";
const weather = tool({
  description: "The weather in a city",
  inputSchema: City,
  execute: async ({ city }) => ({ city, sunny: city === "Rome" }),
});
const time = tool({
  description: "The time in a city",
  inputSchema: City,
  execute: async ({ city }) => ({ city, time: "12:00" }),
});

for (const [prefix, m] of Object.entries(models)) {
  await run(`${prefix}.generateText`, async () => {
    const r = await generateText({ model: m, prompt: "Say hello", maxOutputTokens: 8 });
    return [typeof r.text === "string" && r.usage.inputTokens > 0, { text: r.text, finish: r.finishReason }];
  });

  await run(`${prefix}.streamText`, async () => {
    const r = streamText({ model: m, prompt: "Say hello", maxOutputTokens: 8 });
    let parts = 0;
    for await (const piece of r.textStream) parts += piece.length > 0 ? 1 : 0;
    const finish = await r.finishReason;
    return [parts > 0 && finish === "length", { parts, finish }];
  });

  await run(`${prefix}.generateObject`, async () => {
    const r = await generateObject({ model: m, schema: Forecast, prompt: "The weather in Rome?", maxOutputTokens: 48 });
    return [Forecast.safeParse(r.object).success, r.object];
  });

  await run(`${prefix}.streamObject`, async () => {
    const r = streamObject({ model: m, schema: Forecast, prompt: "The weather in Rome?", maxOutputTokens: 48 });
    let partials = 0;
    for await (const _ of r.partialObjectStream) partials += 1;
    const object = await r.object;
    return [partials > 0 && Forecast.safeParse(object).success, { partials, object }];
  });

  await run(`${prefix}.tools.required`, async () => {
    const r = await generateText({
      model: m, prompt: "What is the weather in Rome?", tools: { get_weather: weather, get_time: time },
      toolChoice: "required", maxOutputTokens: 48,
    });
    const calls = r.toolCalls ?? [];
    return [calls.length > 0 && calls.every((c) => validCity(c.input)), { calls, finish: r.finishReason }];
  });

  // Cut by maxOutputTokens: whatever comes back is whole. A call the budget cut is dropped, never
  // delivered with empty or partial arguments (the SDK would run the tool with them); a call that was
  // complete is never dropped, so a budget that holds one call gets it. Under `required`, a reply
  // without any call is the SDK's ToolChoiceViolationError.
  await run(`${prefix}.tools.cut`, async () => {
    const results = [];
    for (const budget of [6, 12, 24, 48]) {
      try {
        const r = await generateText({
          model: m, prompt: "What is the weather in Rome?", tools: { get_weather: weather, get_time: time },
          toolChoice: "required", maxOutputTokens: budget,
        });
        results.push({ budget, calls: r.toolCalls.map((c) => c.input), finish: r.finishReason });
      } catch (e) {
        if (!toolChoiceViolation(e)) throw e;
        results.push({ budget, calls: [], finish: "no call" });
      }
    }
    const whole = results.every((r) => r.calls.every(validCity));
    return [whole && results.at(-1).calls.length > 0, results];
  });

  await run(`${prefix}.tools.multistep`, async () => {
    const r = await generateText({
      model: m, prompt: "What is the weather in Rome?", tools: { get_weather: weather },
      toolChoice: "required", stopWhen: stepCountIs(2), maxOutputTokens: 48,
    });
    const executed = r.steps.flatMap((s) => s.toolResults ?? []);
    return [r.steps.length === 2 && executed.length >= 1, { steps: r.steps.length, executed: executed.length }];
  });

  await run(`${prefix}.tools.stream`, async () => {
    const r = streamText({
      model: m, prompt: "What is the weather in Rome?", tools: { get_weather: weather },
      toolChoice: "required", maxOutputTokens: 48,
    });
    const calls = [];
    for await (const part of r.fullStream) if (part.type === "tool-call") calls.push(part.input);
    return [calls.length > 0 && calls.every(validCity), { calls }];
  });
}
