// The official openai npm package against a real specserve server of the default model.
// SPECSERVE_URL (the server's base URL) and SPECSERVE_MODEL come from
// tests/sdk/test_node_sdk.py, which starts the server and runs `node --test` on this file.
// Greedy decoding with a small model can write silly values: the checks are about
// structure (valid JSON, schema-valid arguments, the right function), not content.
import assert from "node:assert/strict";
import { test } from "node:test";
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: `${process.env.SPECSERVE_URL}/v1`, apiKey: "unused", maxRetries: 0, timeout: 120_000,
});
const model = process.env.SPECSERVE_MODEL;
const greedy = { model, temperature: 0 };

const PERSON = {
  type: "object",
  properties: { name: { type: "string", maxLength: 20 }, age: { type: "integer" } },
  required: ["name", "age"], additionalProperties: false,
};
const WEATHER = {
  type: "function",
  function: {
    name: "get_weather", description: "The current weather in a city.",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 30 }, unit: { enum: ["c", "f"] } },
      required: ["city", "unit"], additionalProperties: false,
    },
  },
};
const TIME = {
  type: "function",
  function: {
    name: "get_time", parameters: {
      type: "object", properties: { zone: { type: "string", maxLength: 20 } },
      required: ["zone"], additionalProperties: false,
    },
  },
};
const ASK_WEATHER = [{ role: "user", content: "What is the weather in Paris?" }];

// What is wrong with `value` against the subset of JSON Schema used above ([] if nothing).
function problems(schema, value, path = "$") {
  if (schema.enum) return schema.enum.includes(value) ? [] : [`${path} not in enum`];
  switch (schema.type) {
    case "string":
      if (typeof value !== "string") return [`${path} is not a string`];
      return value.length <= (schema.maxLength ?? Infinity) ? [] : [`${path} too long`];
    case "integer":
      return Number.isInteger(value) ? [] : [`${path} is not an integer`];
    case "object": {
      if (value === null || typeof value !== "object" || Array.isArray(value)) {
        return [`${path} is not an object`];
      }
      const out = (schema.required ?? []).filter((k) => !(k in value)).map((k) => `${path}.${k} missing`);
      for (const [key, item] of Object.entries(value)) {
        const sub = schema.properties?.[key];
        if (sub) out.push(...problems(sub, item, `${path}.${key}`));
        else if (schema.additionalProperties === false) out.push(`${path}.${key} not allowed`);
      }
      return out;
    }
    default:
      throw new Error(`the checker does not know ${JSON.stringify(schema)}`);
  }
}

function assertValid(schema, text) {
  const value = JSON.parse(text);
  assert.deepEqual(problems(schema, value), [], text);
  return value;
}

async function collect(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

test("chat completions, whole and streamed (greedy: the same text)", async () => {
  const body = { ...greedy, messages: [{ role: "user", content: "Say hello." }], max_tokens: 16 };
  const whole = await client.chat.completions.create(body);
  const text = whole.choices[0].message.content;
  assert.equal(typeof text, "string");
  assert.ok(text.length > 0);
  assert.ok(["stop", "length"].includes(whole.choices[0].finish_reason));
  assert.ok(whole.usage.completion_tokens > 0 && whole.usage.completion_tokens <= 16);
  const chunks = await collect(await client.chat.completions.create({
    ...body, stream: true, stream_options: { include_usage: true } }));
  const streamed = chunks.map((c) => c.choices[0]?.delta?.content ?? "").join("");
  assert.equal(streamed, text);
  assert.deepEqual(chunks.at(-1).choices, []);
  assert.equal(chunks.at(-1).usage.completion_tokens, whole.usage.completion_tokens);
});

test("legacy completions", async () => {
  const out = await client.completions.create({ ...greedy, prompt: "Once upon a time", max_tokens: 8 });
  assert.equal(out.object, "text_completion");
  assert.equal(typeof out.choices[0].text, "string");
  assert.equal(out.usage.completion_tokens, 8);
});

test("response_format json_schema: JSON valid against the schema", async () => {
  const out = await client.chat.completions.create({
    ...greedy, messages: [{ role: "user", content: "Describe a person." }], max_tokens: 60,
    response_format: { type: "json_schema", json_schema: { name: "person", schema: PERSON, strict: true } },
  });
  assert.equal(out.choices[0].finish_reason, "stop");
  assertValid(PERSON, out.choices[0].message.content);
});

test("response_format json_object: a JSON object", async () => {
  const out = await client.chat.completions.create({
    ...greedy, messages: [{ role: "user", content: "Give a JSON object with a colour." }],
    max_tokens: 60, response_format: { type: "json_object" },
  });
  if (out.choices[0].finish_reason === "stop") {
    const value = JSON.parse(out.choices[0].message.content);
    assert.ok(value !== null && typeof value === "object" && !Array.isArray(value));
  } else { // cut by max_tokens: still the start of an object
    assert.equal(out.choices[0].finish_reason, "length");
    assert.ok(out.choices[0].message.content.startsWith("{"));
  }
});

test("a forced (named) tool call and tool_choice required", async () => {
  for (const tool_choice of [{ type: "function", function: { name: "get_time" } }, "required"]) {
    const out = await client.chat.completions.create({
      ...greedy, messages: ASK_WEATHER, tools: [WEATHER, TIME], tool_choice,
      parallel_tool_calls: false, max_tokens: 60,
    });
    const choice = out.choices[0];
    assert.equal(choice.finish_reason, "tool_calls");
    assert.equal(choice.message.content, null);
    assert.equal(choice.message.tool_calls.length, 1);
    const call = choice.message.tool_calls[0];
    assert.equal(call.type, "function");
    assert.match(call.id, /^call_/);
    const tool = [WEATHER, TIME].find((t) => t.function.name === call.function.name);
    assert.ok(tool, call.function.name);
    if (typeof tool_choice === "object") assert.equal(call.function.name, "get_time");
    assertValid(tool.function.parameters, call.function.arguments);
  }
});

test("tool_choice auto: the model may answer in text", async () => {
  const out = await client.chat.completions.create({
    ...greedy, messages: ASK_WEATHER, tools: [WEATHER], tool_choice: "auto", max_tokens: 24,
  });
  const message = out.choices[0].message;
  assert.equal(typeof message.content, "string");
  assert.ok(message.content.length > 0 && !message.content.startsWith("<tool_call>"));
  assert.ok(!message.tool_calls || message.tool_calls.length === 0);
  assert.notEqual(out.choices[0].finish_reason, "tool_calls");
});

test("streamed tool-call deltas reassemble into the whole call", async () => {
  const body = { ...greedy, messages: ASK_WEATHER, tools: [WEATHER], tool_choice: "required",
    parallel_tool_calls: false, max_tokens: 60 };
  const whole = (await client.chat.completions.create(body)).choices[0].message.tool_calls[0];
  const calls = [];
  let finish = null;
  for await (const chunk of await client.chat.completions.create({ ...body, stream: true })) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    finish = choice.finish_reason ?? finish;
    for (const delta of choice.delta.tool_calls ?? []) {
      calls[delta.index] ??= { id: delta.id, name: delta.function?.name, arguments: "" };
      calls[delta.index].arguments += delta.function?.arguments ?? "";
    }
  }
  assert.equal(finish, "tool_calls");
  assert.equal(calls.length, 1);
  assert.match(calls[0].id, /^call_/);
  assert.equal(calls[0].name, whole.function.name);
  assert.equal(calls[0].arguments, whole.function.arguments);
  assertValid(WEATHER.function.parameters, calls[0].arguments);
});

test("multi-turn with a tool result", async () => {
  const first = await client.chat.completions.create({
    ...greedy, messages: ASK_WEATHER, tools: [WEATHER], tool_choice: "required",
    parallel_tool_calls: false, max_tokens: 60,
  });
  const message = first.choices[0].message;
  const call = message.tool_calls[0];
  const second = await client.chat.completions.create({
    ...greedy, tools: [WEATHER], max_tokens: 24, messages: [
      ...ASK_WEATHER, message,
      { role: "tool", tool_call_id: call.id, content: JSON.stringify({ temperature: 21, unit: "c" }) },
    ],
  });
  assert.ok(second.usage.prompt_tokens > first.usage.prompt_tokens);
  const answer = second.choices[0].message;
  assert.ok(typeof answer.content === "string" || answer.tool_calls?.length > 0);
});

test("responses.create, whole and streamed", async () => {
  const body = { ...greedy, input: "Say hello.", instructions: "Be brief.", max_output_tokens: 16 };
  const whole = await client.responses.create(body);
  assert.equal(whole.object, "response");
  assert.ok(["completed", "incomplete"].includes(whole.status));
  assert.ok(whole.output_text.length > 0);
  const events = await collect(await client.responses.create({ ...body, stream: true }));
  assert.equal(events[0].type, "response.created");
  assert.equal(events.at(-1).type, `response.${whole.status}`);
  assert.deepEqual(events.map((e) => e.sequence_number), events.map((_, i) => i));
  const text = events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join("");
  assert.equal(text, whole.output_text);
  assert.equal(events.at(-1).response.output_text ?? text, text);
});

test("responses.create with a function tool", async () => {
  const out = await client.responses.create({
    ...greedy, input: "What is the weather in Paris?", max_output_tokens: 60,
    tools: [{ type: "function", ...WEATHER.function }], tool_choice: "required",
    parallel_tool_calls: false,
  });
  const calls = out.output.filter((item) => item.type === "function_call");
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, "get_weather");
  assertValid(WEATHER.function.parameters, calls[0].arguments);
});

test("a 400 surfaces as the SDK's BadRequestError", async () => {
  await assert.rejects(
    client.chat.completions.create({ ...greedy, messages: ASK_WEATHER, logit_bias: { 1: 5 } }),
    (err) => err instanceof OpenAI.BadRequestError && err.status === 400 && err.param === "logit_bias",
  );
  await assert.rejects(
    client.responses.create({ ...greedy, input: "x", store: true }),
    (err) => err instanceof OpenAI.BadRequestError && err.param === "store",
  );
});
