"""Make the tau_bench example's data (examples/tau_bench/data/): a retail database and customer tasks on it.

``db.json`` (seed 20261203): 16 users (an email, a credit card, a gift card with a balance), 6 products of 2
variants each, and 2-3 orders per user (``pending`` or ``delivered``). Tasks, one per row of ``train.jsonl``
(24) and ``eval.jsonl`` (16), on disjoint orders (40 orders, one task each):

* **cancel** a pending order (goal: ``cancel_pending_order(order, "no longer needed")``);
* **return** one item of a delivered order to the user's gift card (goal: ``return_delivered_order_items``;
  output the agent must say: the refund, e.g. ``54.27``).

A row: ``{"prompt": [system: the agent's policy], "metadata": {"task": {"task_id", "user_id", "instruction",
"user_turns", "actions", "outputs"}}}`` (no label: ``label_key: ""``); see tau_retail.Task.

    python examples/tau_bench/make_data.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20261203
POLICY = (
    "You are a customer service agent of an online shop. Help the user with their order using the tools. "
    "Identify the user by email first (find_user_id_by_email), look up the order (get_order_details), then act: "
    "cancel a pending order (cancel_pending_order) or return items of a delivered order "
    "(return_delivered_order_items). Tell the user the refund amount. Be brief."
)
FIRST = ["Ada", "Boris", "Clara", "Dmitri", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lev", "Mona",
         "Nils", "Olga", "Piet"]  # fmt: skip
LAST = ["Berg", "Cole", "Dahl", "Frey", "Hale", "Kerr", "Lund", "Moss", "Nash", "Roth", "Shaw", "Voss"]
PRODUCTS = {
    "lamp": ["white", "black"],
    "kettle": ["steel", "red"],
    "backpack": ["green", "grey"],
    "mug": ["blue", "yellow"],
    "scarf": ["wool", "silk"],
    "headphones": ["black", "white"],
}


def _price(rng: random.Random) -> float:
    return round(rng.randint(10, 199) + rng.randint(1, 9) / 10 + rng.randint(1, 9) / 100, 2)  # cents never x0


def make_db(rng: random.Random) -> dict:
    """The database: users, products, orders (see the module docstring)."""
    products: dict = {}
    for p, (product, options) in enumerate(PRODUCTS.items()):
        variants = {f"{1000 + 10 * p + v}": {"option": opt, "price": _price(rng)} for v, opt in enumerate(options)}
        products[f"p{p}"] = {"name": product, "variants": variants}
    users, orders = {}, {}
    n_order = 0
    for i, first in enumerate(FIRST):
        last = LAST[i % len(LAST)]
        uid = f"{first.lower()}_{last.lower()}_{i}"
        cc, gc = f"credit_card_{rng.randint(1000, 9999)}", f"gift_card_{rng.randint(1000, 9999)}"
        users[uid] = {
            "name": f"{first} {last}",
            "email": f"{first.lower()}.{last.lower()}{i}@example.com",
            "payment_methods": {
                cc: {"source": "credit_card"},
                gc: {"source": "gift_card", "balance": float(rng.randint(0, 80))},
            },  # fmt: skip
            "orders": [],
        }
        for k in range(2 + i % 2):
            oid = f"#W{1000 + n_order}"
            n_order += 1
            items = []
            for pid in rng.sample(sorted(products), 2):
                item_id = rng.choice(sorted(products[pid]["variants"]))
                v = products[pid]["variants"][item_id]
                items.append({"item_id": item_id, "product_id": pid, "name": products[pid]["name"],
                              "option": v["option"], "price": v["price"]})  # fmt: skip
            orders[oid] = {
                "order_id": oid,
                "user_id": uid,
                "status": "pending" if k == 0 else "delivered",
                "items": items,
                "payment_method_id": cc,
                "total": round(sum(it["price"] for it in items), 2),
            }
            users[uid]["orders"].append(oid)
    return {"users": users, "products": products, "orders": orders}


def make_tasks(db: dict, rng: random.Random) -> list[dict]:
    """One cancel task per pending order and one return task per delivered order (an item drawn at random)."""
    tasks = []
    for oid, o in sorted(db["orders"].items()):
        u = db["users"][o["user_id"]]
        who = f"I'm {u['name']}, my email is {u['email']}."
        if o["status"] == "pending":
            instruction = f"{who} You want to cancel your order {oid} because you no longer need it."
            turns = [f"Hi! {who} Please cancel my order {oid}, I no longer need it.", "Yes, please go ahead."]
            actions = [{"name": "cancel_pending_order", "arguments": {"order_id": oid, "reason": "no longer needed"}}]
            outputs: list[str] = []
            kind = "cancel"
        else:
            item = rng.choice(o["items"])
            gift = next(k for k, v in u["payment_methods"].items() if v["source"] == "gift_card")
            instruction = (
                f"{who} You want to return the {item['name']} ({item['option']}) of your order {oid} and get the "
                "refund on your gift card. You want to know how much is refunded."
            )
            turns = [
                f"Hi! {who} I want to return the {item['name']} from order {oid}. Please refund it to my gift card.",
                "Yes, please do it. How much will I get back?",
            ]
            actions = [{"name": "return_delivered_order_items", "arguments": {
                "order_id": oid, "item_ids": [item["item_id"]], "payment_method_id": gift}}]  # fmt: skip
            outputs = [f"{item['price']:.2f}"]
            kind = "return"
        tasks.append({"task_id": f"{kind}-{oid[1:]}", "user_id": o["user_id"], "instruction": instruction,
                      "user_turns": turns, "actions": actions, "outputs": outputs})  # fmt: skip
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    rng = random.Random(SEED)
    db = make_db(rng)
    tasks = make_tasks(db, rng)
    rng.shuffle(tasks)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "db.json").write_text(json.dumps(db, indent=1, sort_keys=True) + "\n")
    print(f"db: {len(db['users'])} users, {len(db['orders'])} orders -> {args.out_dir / 'db.json'}")
    for name, part in (("eval", tasks[:16]), ("train", tasks[16:])):
        path = args.out_dir / f"{name}.jsonl"
        rows = [{"prompt": [{"role": "system", "content": POLICY}], "metadata": {"task": t}} for t in part]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {len(rows)} tasks -> {path}")


if __name__ == "__main__":
    main()
